"""The comparison as Markdown (the README includes it), as detailed JSON (``{level: {scorer: metrics}}`` per
dataset, which ``register`` reads) and as headline ``dvc metrics`` (a few numbers per dataset x level, read at a
glance): one section per dataset x level with the trained detectors, the trained baselines and the training-free
baselines apart, each sorted by test AUROC, ``0.734 [0.68, 0.79]`` for an AUROC and its 95% bootstrap interval and,
for a seed ensemble, the spread of its single seeds; a sentence for each scorer whose interval lies below 0.5
(inverted); then the paired differences of each trained detector from the best training-free baseline. The headline
of evaluate_directions' report (:func:`directions_headline`) is here too."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from detectors.evaluation.compare import COLUMNS, KINDS
from detectors.interfaces import Level
from detectors.io import write_json

LEVEL_ORDER = {level.value: i for i, level in enumerate(Level)}  # question, token, entity, continuation
DIGITS = 4  # a headline metric's rounding (the detailed reports keep every digit)


def _interval(value: float, low: float, high: float, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    head = f"{value:+.3f}" if signed else f"{value:.3f}"
    return f"{head} [{low:+.2f}, {high:+.2f}]" if signed else f"{head} [{low:.2f}, {high:.2f}]"


def _seeds(row) -> str:
    """A seed ensemble's single seeds: ``0.71–0.76 (sd 0.02, 5 seeds)``; empty for any other scorer."""
    if not isinstance(row.seeds, (int, float)) or math.isnan(row.seeds):
        return ""
    return f"{row.seed_auroc_min:.3f}–{row.seed_auroc_max:.3f} (sd {row.seed_auroc_sd:.3f}, {int(row.seeds)} seeds)"


def inverted(part: pd.DataFrame) -> list[str]:
    """A sentence for each scorer of ``part`` whose whole AUROC interval lies below 0.5: it ranks the correct units
    above the hallucinated ones, a sign the comparison does not choose for it."""
    return [
        f"**Inverted:** `{r.scorer}` scores correct units above hallucinated ones (AUROC "
        f"{_interval(r.auroc, r.auroc_ci_low, r.auroc_ci_high)}, wholly below 0.5): its sign was not chosen on "
        f"validation, and read the other way it separates them with AUROC {1 - r.auroc:.3f}."
        for r in part.itertuples(index=False)
        if isinstance(r.auroc_ci_high, float) and r.auroc_ci_high < 0.5
    ]


def markdown_table(table: pd.DataFrame) -> str:
    """Markdown of the long comparison table (:data:`~detectors.evaluation.compare.COLUMNS`)."""
    table = table.reindex(columns=list(COLUMNS))
    out = [
        "# Comparison of every scorer on the test splits",
        "",
        "AUROC with its 95% bootstrap interval (clusters = questions, or continuations at token and entity level); "
        "accuracy, F1 and trigger rate at the threshold chosen on validation; ECE after a Platt map fitted on "
        "validation "
        "for scores that are not probabilities. Trained detectors come first, then trained baselines (fitted on the "
        "train split by the comparison), then the training-free baselines, each sorted by AUROC. A trained detector is "
        "the mean probability of nets trained with several seeds; single seeds: the test AUROC of each seed's net "
        "alone (lowest–highest, standard deviation). Δ AUROC: paired bootstrap interval of a trained detector's AUROC "
        "minus that of the best training-free baseline at the same dataset and level, on the same resampled examples.",
        "",
    ]
    keys = table[["dataset", "level"]].drop_duplicates()
    keys = keys.assign(order=keys["level"].map(LEVEL_ORDER)).sort_values(["dataset", "order"])
    for dataset, level in keys[["dataset", "level"]].itertuples(index=False):
        part = table[(table["dataset"] == dataset) & (table["level"] == level)]
        part = part.assign(group=part["kind"].map({k: i for i, k in enumerate(KINDS)}).fillna(len(KINDS)))
        part = part.sort_values(["group", "auroc"], ascending=[True, False], kind="stable")
        first = part.iloc[0]
        out += [
            f"## {dataset} · {level} (test: {int(first['n'])} units, {first['positive_rate']:.0%} hallucinated)",
            "",
            "| scorer | kind | AUROC [95% CI] | AUPRC | accuracy | F1 | ECE | trigger rate | single seeds: AUROC |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in part.itertuples(index=False):
            auroc = _interval(r.auroc, r.auroc_ci_low, r.auroc_ci_high)
            rest = f"{r.auprc:.3f} | {r.accuracy:.3f} | {r.f1:.3f} | {r.ece:.3f} | {r.trigger_rate:.2f}"
            out.append(f"| {r.scorer} | {r.kind} | {auroc} | {rest} | {_seeds(r)} |")
        if notes := inverted(part):
            out += ["", *notes]
        deltas = part[part["delta_vs"].notna()]
        if len(deltas):
            out += ["", "| detector | vs best training-free baseline | Δ AUROC [95% CI] |", "| --- | --- | --- |"]
            for r in deltas.itertuples(index=False):
                out.append(
                    f"| {r.scorer} | {r.delta_vs} | "
                    f"{_interval(r.delta_auroc, r.delta_ci_low, r.delta_ci_high, signed=True)} |"
                )
        out.append("")
    return "\n".join(out)


def nested_metrics(table: pd.DataFrame, dataset: str) -> dict[str, dict[str, dict]]:
    """``{level: {scorer: metrics}}`` of one dataset, the shape of both detailed reports
    (``paths.evaluate_*_metrics``)."""
    part = table[table["dataset"] == dataset]
    metrics = [c for c in COLUMNS if c not in ("scorer", "dataset", "level", "features")]
    out: dict[str, dict[str, dict]] = {}
    for row in part.to_dict("records"):
        values = {
            k: row[k] for k in metrics if not (isinstance(row[k], float) and math.isnan(row[k])) and row[k] is not None
        }
        out.setdefault(row["level"], {})[row["scorer"]] = values
    return out


def headline_value(value) -> float | None:
    """A headline metric: ``value`` rounded to :data:`DIGITS`, None when it is missing (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return round(float(value), DIGITS)


def write_headline(directory: str | Path, rows: dict[str, dict]) -> None:
    """Write each of a headline's ``rows`` as ``<name>.json`` in ``directory`` (its ``dvc metrics`` directory: one table
    row per file) and remove its other ``.json`` files, so that no row of an earlier run is left behind."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, row in rows.items():
        write_json(directory / f"{name}.json", row)
    for stale in directory.glob("*.json"):
        if stale.stem not in rows:
            stale.unlink()


def headline(table: pd.DataFrame) -> dict[str, dict[str, float | str]]:
    """The comparison at a glance (evaluate's ``dvc metrics``): one row per ``<dataset>_<level>`` (one small JSON file
    each, so that ``dvc metrics show`` prints one line per row and the rows share their columns): ``dior`` and
    ``dior_name``, the highest test AUROC of the trained detectors (DioR's, its extensions and ablations; the first of
    equals) and its detector; ``baseline`` and ``baseline_name``, the test AUROC and name of the baseline the detectors'
    paired differences are against (``delta_vs``: the baseline of the highest test AUROC). Every detector's number is in
    the detailed reports and on the comparison page."""
    keys = table[["dataset", "level"]].drop_duplicates()
    keys = keys.assign(order=keys["level"].map(LEVEL_ORDER)).sort_values(["dataset", "order"])
    out: dict[str, dict[str, float | str]] = {}
    for dataset, level in keys[["dataset", "level"]].itertuples(index=False):
        part = table[(table["dataset"] == dataset) & (table["level"] == level)]
        detectors = part[part["kind"] == "detector"]
        row: dict[str, float | str] = {}
        scored = detectors.dropna(subset=["auroc"])
        if len(scored):
            best = scored.loc[scored["auroc"].idxmax()]
            row |= {"dior": headline_value(best["auroc"]), "dior_name": str(best["scorer"])}
        vs = detectors["delta_vs"].dropna()
        if len(vs) and (auroc := headline_value(part.loc[part["scorer"] == vs.iloc[0], "auroc"].iloc[0])) is not None:
            row |= {"baseline": auroc, "baseline_name": str(vs.iloc[0])}
        if row:
            out[f"{dataset}_{level}"] = row
    return out


def directions_headline(metrics: dict) -> dict[str, float]:
    """evaluate_directions' report (``paths.evaluate_directions_metrics``) at a glance, flat keys: the test AUROC of the
    honesty direction (held-out true vs false statements) and of the confidence monitor (early set, hallucinated
    answers) at each layer range (``paper``, ``validation``), and TruthfulQA MC1 accuracy at λ = 0 (no steering) and at
    the best λ of the grid (the smallest of equals) with that λ."""
    out: dict[str, float] = {}
    for concept, section in (("honesty", "honesty"), ("confidence", "confidence_early")):
        for name, r in metrics.get(section, {}).get("ranges", {}).items():
            if (auroc := headline_value(r.get("test_auroc"))) is not None:
                out[f"{concept}.test_auroc.{name}"] = auroc
    accuracy = {float(lam): value for lam, value in metrics.get("truthfulqa", {}).get("accuracy", {}).items()}
    if 0.0 in accuracy:
        out["truthfulqa.accuracy.lambda_0"] = headline_value(accuracy[0.0])
    if accuracy:
        best = max(sorted(accuracy), key=lambda lam: accuracy[lam])
        out["truthfulqa.accuracy.best_lambda"], out["truthfulqa.best_lambda"] = headline_value(accuracy[best]), best
    return out


def directions_markdown(metrics: dict) -> str:
    """evaluate_directions' report as a results page: per concept and layer range the layers and the validation and
    test AUROC (honesty: held-out true vs false statements; confidence: hallucinated answers of the early set, and
    generated tokens of the real-time set), and TruthfulQA MC1 accuracy under honesty steering for each λ."""

    def cell(value) -> str:
        return "n/a" if headline_value(value) is None else f"{value:.3f}"

    sections = (
        ("honesty", "honesty: true vs false statements (test statements)"),
        ("confidence_early", "confidence monitor: hallucinated answers of the early set (test questions)"),
        ("confidence_realtime", "confidence monitor: hallucinated tokens of the real-time set (test tokens)"),
    )
    lines = [
        "# CtrlA's directions",
        "",
        "Written by `evaluate_directions` ([../detectors.md](../detectors.md) says how the directions are built and",
        "scored). `paper`: CtrlA's layer range scaled to the LLM's depth; `validation`: the window chosen on",
        "validation.",
        "",
        "| what | range | layers | validation AUROC | test AUROC |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for key, what in sections:
        for name, r in metrics.get(key, {}).get("ranges", {}).items():
            layers = r.get("layers") or []
            span = f"{min(layers)}-{max(layers)}" if layers else ""
            lines.append(f"| {what} | {name} | {span} | {cell(r.get('val_auroc'))} | {cell(r.get('test_auroc'))} |")
    accuracy = metrics.get("truthfulqa", {}).get("accuracy", {})
    if accuracy:
        n = metrics["truthfulqa"].get("n")
        lines += ["", f"TruthfulQA MC1 accuracy under honesty steering ({n} questions):", ""]
        lines += ["| λ | accuracy |", "| ---: | ---: |"]
        lines += [f"| {float(lam):g} | {cell(value)} |" for lam, value in accuracy.items()]
    return "\n".join(lines) + "\n"
