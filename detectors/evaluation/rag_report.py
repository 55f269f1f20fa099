"""The RAG evaluation as Markdown (shaped like DioR's Tables 1–4: metrics as rows, configurations as columns, one
block per corpus), from the metrics :mod:`detectors.evaluation.rag_metrics` gives and the curves' summaries ``sweep``
gives; at a glance, as the stage's ``dvc metrics`` (:func:`headline`); and the curves (CSV) and prompts (JSON lines)
files. The MLflow runs: :mod:`detectors.evaluation.rag_tracking`."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detectors.evaluation.rag_metrics import TRADE
from detectors.evaluation.report import headline_value

DELTA = "delta"  # a paired difference with its interval: ``key``, ``key_ci_low``, ``key_ci_high``
ROWS = (  # metric key, row label, format
    ("em", "EM", "{:.3f}"),
    ("f1", "F1", "{:.3f}"),
    ("accuracy", "Acc (containment)", "{:.3f}"),
    ("answer_recall_at_k", "answer recall@k", "{:.3f}"),
    ("retrievals_per_question", "retrievals / question", "{:.2f}"),
    ("searches_per_question", "searches / question", "{:.2f}"),
    ("trigger_rate", "trigger rate", "{:.2f}"),
    ("forward_passes_per_question", "forward passes / question", "{:.1f}"),
    ("generated_tokens_per_question", "generated tokens / question", "{:.1f}"),
    ("wall_s_per_question", "wall s / question", "{:.2f}"),
    ("n", "questions", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("no_passage", "nothing retrieved", "{:d}"),
    ("val_accuracy", "Acc on validation at its chosen point", "{:.3f}"),
    ("val_retrievals_per_question", "retrievals / question on validation", "{:.2f}"),
    ("accuracy_vs_never", "Acc − no retrieval [95% CI]", DELTA),
    ("accuracy_vs_always", "Acc − always retrieve [95% CI]", DELTA),
    ("accuracy_vs_versus", "Acc − the row it isolates a step against [95% CI]", DELTA),
)
TRADE_ROW = "vs always retrieve: retrievals saved at its accuracy or more, else accuracy lost"
BOLD = ("em", "f1", "accuracy")  # the best configuration of each corpus is in bold


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _cell(value: Any, fmt: str) -> str:
    if _missing(value):
        return "–"
    return fmt.format(int(value) if fmt == "{:d}" else float(value))


def _delta(values: Mapping[str, Any], key: str) -> str:
    """``+0.120 [+0.070, +0.170]``: a difference and its interval."""
    value, low, high = (values.get(k) for k in (key, f"{key}_ci_low", f"{key}_ci_high"))
    if _missing(value):
        return "–"
    interval = "" if _missing(low) or _missing(high) else f" [{low:+.3f}, {high:+.3f}]"
    return f"{value:+.3f}{interval}"


def markdown_table(metrics: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """``{corpus: {configuration: metrics}}`` as Markdown: one block per corpus, a row per metric, a column per
    configuration (in the given order); the best EM, F1 and accuracy of each corpus in bold (every tied one)."""
    out = []
    for corpus, configs in metrics.items():
        names = list(configs)
        out += [
            f"### corpus `{corpus}`",
            "",
            "| metric | " + " | ".join(names) + " |",
            "| --- |" + " ---: |" * len(names),
        ]
        for key, label, fmt in ROWS:
            if fmt == DELTA:
                if any(key in configs[c] for c in names):
                    cells = [_delta(configs[c], key) for c in names]
                    if key == "accuracy_vs_versus":
                        cells = [
                            f"{x} vs {configs[c]['versus']}" if "versus" in configs[c] else x
                            for c, x in zip(names, cells)
                        ]
                    out.append(f"| {label} | " + " | ".join(cells) + " |")
                continue
            values = [configs[c].get(key) for c in names]
            cells = [_cell(v, fmt) for v in values]
            if key in BOLD:
                present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
                best = max(present, default=None)
                cells = [
                    f"**{c}**" if v is not None and best is not None and float(v) == best else c
                    for v, c in zip(values, cells)
                ]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        if any(k in configs[c] for c in names for k in TRADE):
            out.append(f"| {TRADE_ROW} | " + " | ".join(_trade(configs[c]) for c in names) + " |")
        most = max((int(configs[c].get("n") or 0) for c in names), default=0)
        fewer = [c for c in names if configs[c].get("n") is not None and int(configs[c]["n"]) < most]
        if fewer:
            out += [
                "",
                f"{', '.join(fewer)}: on a fixed sample of "
                f"{', '.join(str(int(configs[c]['n'])) for c in fewer)} of the {most} test questions "
                "(`rag_eval.framework_questions`); their differences are paired on those questions.",
            ]
        out.append("")
    return "\n".join(out)


def _trade(values: Mapping[str, Any]) -> str:
    saved, lost = (values.get(k) for k in TRADE)
    if not _missing(saved):
        return f"saves {saved:.0%}" if saved >= 0 else f"{1 - saved:.1f}× the retrievals"
    return "–" if _missing(lost) else f"loses {lost:.3f}"


def headline(
    metrics: Mapping[str, Mapping[str, Mapping[str, Any]]], references: Mapping[str, str], dior: Sequence[str]
) -> dict[str, dict[str, float | str]]:
    """The RAG evaluation at a glance (rag_eval's ``dvc metrics``): one row per corpus of ``metrics`` (``{corpus:
    {configuration: metrics}}``; one small JSON file each, so that ``dvc metrics show`` prints one line per corpus with
    the same columns as evaluate's rows): ``dior`` and ``dior_name``, the highest accuracy of DioR's configurations
    (``dior``: their names) and its configuration; ``baseline`` and ``baseline_name``, the same of every other
    configuration but the ``references`` (the first of equals, in ``metrics``' order); ``always`` and ``never``, the
    accuracy of the references (``{"always": name, "never": name}``). Missing values are left out
    (:func:`~detectors.evaluation.report.headline_value`); every configuration's numbers are in the detailed report and
    on the RAG page."""
    out: dict[str, dict[str, float | str]] = {}
    for corpus, configs in metrics.items():
        acc = {name: a for name, values in configs.items() if (a := headline_value(values.get("accuracy"))) is not None}
        row: dict[str, float | str] = {}
        if ours := [name for name in dior if name in acc]:
            best = max(ours, key=lambda name: acc[name])
            row |= {"dior": acc[best], "dior_name": best}
        if others := [name for name in acc if name not in dior and name not in references.values()]:
            best = max(others, key=lambda name: acc[name])
            row |= {"baseline": acc[best], "baseline_name": best}
        row |= {ref: acc[name] for ref, name in sorted(references.items()) if name in acc}
        out[corpus] = row
    return out


def curves_table(sweep: Mapping[str, Any]) -> str:
    """The curves' summaries (``{"corpus", "query", "curves": {trigger: summary}}``) as Markdown: a row per trigger."""
    out = [
        (
            f"### accuracy vs retrieval rate on corpus `{sweep['corpus']}` (one retrieval at the first crossing, "
            f"query `{sweep['query']}`)"
        ),
        "",
        (
            "| trigger | area | random area | area − random [95% CI] | area − best training-free [95% CI] | retrieval "
            "rate to reach always-accuracy |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for trigger, s in sweep["curves"].items():
        best = s.get("best_training_free")
        versus = (
            "–"
            if best is None
            else "(the best)"
            if best == trigger
            else f"{_delta(s, 'area_over_best_training_free')} vs {best}"
        )
        out.append(
            f"| {trigger} | {s['area']:.3f} | {s['random_area']:.3f} | {_delta(s, 'area_over_random')} | {versus} "
            f"| {_cell(s['rate_to_always'], '{:.2f}')} |"
        )
    if sweep["curves"]:
        first = next(iter(sweep["curves"].values()))
        out += [
            "",
            (
                f"No retrieval: accuracy {first['never_accuracy']:.3f}; always retrieving before generating: "
                f"{first['always_accuracy']:.3f}."
            ),
        ]
    return "\n".join(out) + "\n"


def tuning_table(tuning: Mapping[str, Mapping[str, Mapping[str, Any]]], n_val: int) -> str:
    """Each configuration's operating point as Markdown (``tuning``: ``{corpus: {configuration: {"chosen", "default",
    "candidates": [{"label", "thresholds", "accuracy", "retrievals_per_question", "delta"}]}}}``): a row per
    configuration, a column per corpus, every candidate as ``label: thresholds → accuracy (retrievals / question)`` on
    the validation questions with its paired difference to the default, the default marked, the chosen one in bold."""
    corpora = list(tuning)
    names = list(dict.fromkeys(name for chosen in tuning.values() for name in chosen))
    out = [
        f"### operating points: each configuration's own procedure on the {n_val} validation questions at candidate "
        "thresholds (label: threshold → accuracy (retrievals / question), Δ accuracy − the default [95% CI]; inf = "
        "never retrieve, -inf = always). The default (†) is never retrieving, or always when it is surely better "
        "(paired interval above 0); a candidate replaces it only when its own paired interval over it is above 0; "
        "chosen in bold",
        "",
        "| configuration | " + " | ".join(corpora) + " |",
        "| --- |" + " --- |" * len(corpora),
    ]
    for name in names:
        cells = []
        for corpus in corpora:
            t = tuning[corpus].get(name)
            if t is None:
                cells.append("–")
                continue
            tried = []
            for j, c in enumerate(t["candidates"]):
                where = ", ".join(f"{k} {v:.4g}" for k, v in c["thresholds"].items()) or "no threshold"
                text = f"{c.get('label', j)}: {where} → {c['accuracy']:.3f} ({c['retrievals_per_question']:.2f})"
                if len(t["candidates"]) > 1 and j != t.get("default"):
                    d, low, high = c["delta"]
                    text += f", Δ {d:+.3f} [{low:+.3f}, {high:+.3f}]"
                if j == t.get("default") and len(t["candidates"]) > 1:
                    text += " †"
                tried.append(f"**{text}**" if j == t["chosen"] else text)
            cells.append("<br>".join(tried))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write_curves(path: str | Path, curves: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["trigger", "threshold", "retrieval_rate", "accuracy"])
        writer.writeheader()
        for c in curves.values():
            writer.writerows(c.rows())


def write_prompts(path: str | Path, lines: dict[str, dict[str, list[dict]]], sample_size: int) -> None:
    """Every prompt of the first ``sample_size`` questions of each corpus × configuration, one JSON line each."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for corpus, configs in lines.items():
            for name, results in configs.items():
                for line in results[:sample_size]:
                    f.write(
                        json.dumps(
                            {
                                "corpus": corpus,
                                "configuration": name,
                                "id": line["id"],
                                "prompts": line.get("prompts", []),
                            }
                        )
                        + "\n"
                    )
