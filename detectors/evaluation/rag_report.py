"""The RAG evaluation as Markdown (shaped like DioR's Tables 1–4: metrics as rows, configurations as columns, one
block per corpus) and in MLflow (one run per corpus × configuration with the same metric names, one per swept
trigger), from the metrics ``summarise`` gives, each configuration's paired differences to the reference configurations
(:func:`reference_deltas`) and the curves' summaries ``sweep`` gives; at a glance, as the stage's ``dvc metrics``
(:func:`headline`); and the curves (CSV) and prompts (JSON lines) files."""

from __future__ import annotations

import csv
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from detectors.evaluation.answer_metrics import accuracy
from detectors.evaluation.bootstrap import paired_mean_delta
from detectors.evaluation.report import headline_value
from detectors.registry import store

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
# AdaRAGUE's view against always retrieving (:func:`versus_always`)
TRADE = (
    "retrievals_saved_vs_always",
    "accuracy_lost_vs_always",
)
TRADE_ROW = "vs always retrieve: retrievals saved at its accuracy or more, else accuracy lost"
BOLD = ("em", "f1", "accuracy")  # the best configuration of each corpus is in bold
SWEEP_METRICS = (
    "area",
    "random_area",
    "area_over_random",
    "area_over_random_ci_low",
    "area_over_random_ci_high",
    "never_accuracy",
    "always_accuracy",
    "rate_to_always",
)


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


def versus_always(configs: Mapping[str, Mapping[str, Any]], always: str) -> dict[str, dict[str, float]]:
    """AdaRAGUE's comparison with always retrieving, per configuration of one corpus: where its accuracy is at least the
    ``always`` configuration's, ``retrievals_saved_vs_always`` = 1 − its retrievals per question / always's (negative:
    it retrieves more); else ``accuracy_lost_vs_always``, always's accuracy minus its own (the paired interval of that
    difference is ``accuracy_vs_always``'s)."""
    if always not in configs:
        return {name: {} for name in configs}
    ref = configs[always]
    out = {}
    for name, values in configs.items():
        lost = float(ref["accuracy"]) - float(values["accuracy"])
        if lost <= 0:
            out[name] = {
                TRADE[0]: 1.0 - float(values["retrievals_per_question"]) / float(ref["retrievals_per_question"])
            }
        else:
            out[name] = {TRADE[1]: lost}
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


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``values`` (None, NaN and infinities are left out rather than logged)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[key] = float(value)
    return out


def _check(metrics: Mapping, params: Mapping, tags: Mapping, corpus_digests: Mapping) -> None:
    if not metrics or not any(metrics.values()):
        raise ValueError("log_rag_runs: no metrics to log ({corpus: {configuration: metrics}} is empty)")
    missing = sorted({c for configs in metrics.values() for c in configs} - set(params))
    if missing:
        raise ValueError(
            f"log_rag_runs: configurations {missing} have metrics but no params (triggers, query): pass "
            f"params[configuration]"
        )
    for key in ("llm_digest",):
        if not str(tags.get(key, "")).strip():
            raise ValueError(f"log_rag_runs: tags lack {key!r}: every RAG run is tagged with the LLM it ran")
    absent = sorted(set(metrics) - set(corpus_digests))
    if absent:
        raise ValueError(
            f"log_rag_runs: corpora {absent} have no digest: pass corpus_digests[corpus] (the index manifest's digest)"
        )


def reference_deltas(
    results: dict[str, Sequence[dict]],
    answers: Mapping[str, Sequence[str]],
    references: dict[str, str],
    n: int = 1000,
    seed: int = 0,
    versus: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per configuration, its accuracy minus each reference configuration's (``references``: ``{"never": name,
    "always": name}``, no retrieval and retrieving once before generating) with the paired 95% bootstrap interval:
    ``accuracy_vs_<reference>``, ``..._ci_low``, ``..._ci_high``; and minus the configuration ``versus`` names for it
    (``accuracy_vs_versus`` and its interval, ``versus``: that configuration). Pairs are the questions both answered
    (``answers``: the references of each question, by the ``id`` of the results' lines; a framework may answer a sample
    of them). A reference absent from ``results`` is left out."""
    correct = {
        name: {r["id"]: accuracy(r["answer"], answers[r["id"]]) for r in lines} for name, lines in results.items()
    }

    def paired(name: str, other: str, key: str) -> dict[str, float]:
        ids = [i for i in correct[other] if i in correct[name]]
        delta, low, high = paired_mean_delta([correct[name][i] for i in ids], [correct[other][i] for i in ids], n, seed)
        return {key: delta, f"{key}_ci_low": low, f"{key}_ci_high": high}

    out: dict[str, dict[str, Any]] = {name: {} for name in results}
    for ref, ref_name in references.items():
        if ref_name in correct:
            for name in correct:
                out[name].update(paired(name, ref_name, f"accuracy_vs_{ref}"))
    for name, other in (versus or {}).items():
        if name in correct and other in correct:
            out[name].update(paired(name, other, "accuracy_vs_versus"), versus=other)
    return out


def log_rag_runs(
    metrics: Mapping[str, Mapping[str, Mapping[str, Any]]],
    curves: Mapping[str, Any] | None,
    params: Mapping[str, Mapping[str, Any]],
    experiment: str,
    tags: Mapping[str, str],
    artifact_root: str | None,
    corpus_digests: Mapping[str, str],
) -> list[str]:
    """Log one run per corpus × configuration in ``experiment`` (created under ``artifact_root``), named
    ``"<configuration> · <corpus>"``, with the same metric names in every run (a None or NaN value is left out) and tags
    ``corpus``, ``configuration``, ``triggers`` (comma-joined, ``none`` for none), ``query``, ``corpus_digest``,
    ``llm_digest`` plus ``tags`` and a ``rag_eval`` id of this logging; ``params[configuration]`` is the configuration
    as in params.yaml (its other keys become MLflow params). ``curves`` (the metrics file's ``sweep``: ``corpus``,
    ``query``, ``curves: {trigger: summary}``) adds one run per trigger, ``"sweep · <trigger>"``, tagged
    ``configuration=sweep`` and ``trigger``. Then the experiment's earlier runs are soft-deleted (restorable until
    ``mlflow gc``), so the runs table shows one logging. Returns the new runs' ids."""
    _check(metrics, params, tags, corpus_digests)
    client = MlflowClient()
    exp = store.experiment(experiment, artifact_root)
    logging_id = uuid.uuid4().hex[:12]
    new = []
    for corpus, configs in metrics.items():
        for name, values in configs.items():
            config = dict(params[name])
            run_tags = {
                **tags,
                "corpus": corpus,
                "configuration": name,
                "triggers": ",".join(config.pop("triggers", [])) or "none",
                "query": str(config.pop("query", "")),
                "corpus_digest": corpus_digests[corpus],
                "rag_eval": logging_id,
            }
            with mlflow.start_run(experiment_id=exp, run_name=f"{name} · {corpus}", tags=run_tags) as run:
                mlflow.log_params({k: str(v) for k, v in config.items()})
                mlflow.log_metrics(_numbers(values))
            new.append(run.info.run_id)
    if curves:
        for trigger, summary in curves["curves"].items():
            run_tags = {
                **tags,
                "corpus": curves["corpus"],
                "configuration": "sweep",
                "trigger": trigger,
                "triggers": trigger,
                "query": curves["query"],
                "corpus_digest": corpus_digests.get(curves["corpus"], ""),
                "rag_eval": logging_id,
            }
            with mlflow.start_run(experiment_id=exp, run_name=f"sweep · {trigger}", tags=run_tags) as run:
                mlflow.log_metrics(_numbers({k: summary.get(k) for k in SWEEP_METRICS}))
            new.append(run.info.run_id)
    for old in client.search_runs([exp], "", ViewType.ACTIVE_ONLY, max_results=50000):
        if old.info.run_id not in new:
            client.delete_run(old.info.run_id)
    return new


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
