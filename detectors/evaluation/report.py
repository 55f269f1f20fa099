"""The comparison as Markdown (the README includes it) and as ``dvc metrics`` JSON: one section per dataset x
level with the scorers sorted by test AUROC, ``0.734 [0.68, 0.79]`` for an AUROC and its 95% bootstrap
interval, then the paired differences of each trained detector from the best training-free baseline."""

from __future__ import annotations

import math

import pandas as pd

from detectors.evaluation.compare import COLUMNS
from detectors.interfaces import Level

LEVEL_ORDER = {level.value: i for i, level in enumerate(Level)}  # question, token, entity, continuation


def _interval(value: float, low: float, high: float, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    head = f"{value:+.3f}" if signed else f"{value:.3f}"
    return f"{head} [{low:+.2f}, {high:+.2f}]" if signed else f"{head} [{low:.2f}, {high:.2f}]"


def markdown_table(table: pd.DataFrame) -> str:
    """Markdown of the long comparison table (:data:`~detectors.evaluation.compare.COLUMNS`)."""
    table = table.reindex(columns=list(COLUMNS))
    out = ["# Comparison of every scorer on the test splits", "",
           "AUROC with its 95% bootstrap interval (clusters = questions, or continuations at token and entity level); "
           "accuracy, F1 and trigger rate at the threshold chosen on validation; ECE after a Platt map fitted on validation "
           "for scores that are not probabilities. Δ AUROC: paired bootstrap interval of a trained detector's AUROC minus "
           "that of the best training-free baseline at the same dataset and level, on the same resampled examples.", ""]  # fmt: skip
    keys = table[["dataset", "level"]].drop_duplicates()
    keys = keys.assign(order=keys["level"].map(LEVEL_ORDER)).sort_values(["dataset", "order"])
    for dataset, level in keys[["dataset", "level"]].itertuples(index=False):
        part = table[(table["dataset"] == dataset) & (table["level"] == level)].sort_values("auroc", ascending=False)
        first = part.iloc[0]
        out += [f"## {dataset} · {level} (test: {int(first['n'])} units, {first['positive_rate']:.0%} hallucinated)", "",
                "| scorer | kind | AUROC [95% CI] | AUPRC | accuracy | F1 | ECE | trigger rate |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in part.itertuples(index=False):
            auroc = _interval(r.auroc, r.auroc_ci_low, r.auroc_ci_high)
            rest = f"{r.auprc:.3f} | {r.accuracy:.3f} | {r.f1:.3f} | {r.ece:.3f} | {r.trigger_rate:.2f}"
            out.append(f"| {r.scorer} | {r.kind} | {auroc} | {rest} |")
        deltas = part[part["delta_vs"].notna()]
        if len(deltas):
            out += ["", "| detector | vs best baseline | Δ AUROC [95% CI] |", "| --- | --- | --- |"]
            for r in deltas.itertuples(index=False):
                out.append(f"| {r.scorer} | {r.delta_vs} | {_interval(r.delta_auroc, r.delta_ci_low, r.delta_ci_high, signed=True)} |")
        out.append("")
    return "\n".join(out)


def nested_metrics(table: pd.DataFrame, dataset: str) -> dict[str, dict[str, dict]]:
    """``{level: {scorer: metrics}}`` of one dataset, the shape of both ``dvc metrics`` files."""
    part = table[table["dataset"] == dataset]
    metrics = [c for c in COLUMNS if c not in ("scorer", "dataset", "level", "features")]
    out: dict[str, dict[str, dict]] = {}
    for row in part.to_dict("records"):
        values = {k: row[k] for k in metrics if not (isinstance(row[k], float) and math.isnan(row[k])) and row[k] is not None}
        out.setdefault(row["level"], {})[row["scorer"]] = values
    return out
