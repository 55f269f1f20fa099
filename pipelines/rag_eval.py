"""Stage rag_eval: registered detectors and training-free triggers inside a dynamic RAG loop, measured end to end.

Reads the params, runs the library's evaluation (:func:`detectors.rag.experiment.run_evaluation`) and
writes what it found. On a deterministic sample of the QA test split (by id hash), every configuration of
``rag_eval.configurations`` answers every question over every corpus of ``rag_eval.corpora`` (the bm25s indexes of
``index_corpus``) at its operating point for that corpus: the thresholds ``rag_eval.thresholds`` (or the
configuration's own) fix, else the candidate the rule of choices picks on the corpus's QA *validation* questions
(never and always retrieving, and points of the validation sweep's curves: :mod:`detectors.evaluation.rag_tuning`;
test questions never choose anything); every framework of ``rag_eval.frameworks`` (RetroRAG) answers a fixed sample of
them with its own loop. Each run (``paths.rag_runs/<corpus>/<run>/``) is a resumable shard store
(:func:`detectors.rag.systems.run_questions`): a killed run resumes where it stopped, a question whose loop raised is
computed again by the next run, and a run written under other params, code, LLM, corpus, questions, thresholds or
registered detectors is started again (its manifest says what changed). On the sweep corpus, every trigger's curve is
measured on the test questions too (the run ``sweep``), its area compared with random's and with the best
training-free trigger's (paired bootstrap intervals).

Writes ``paths.rag_metrics`` (``{corpus: {configuration: metrics}}``, ``sweep`` (the curves' summaries),
``thresholds``, ``tuning`` (each configuration's candidates and choice) and ``digests`` (LLM and corpora)), its
headline ``paths.rag_headline`` (``dvc metrics``), the Markdown table ``paths.rag_table``, the curves CSV
``paths.rag_curves`` and their figure ``paths.rag_curves_plot`` (``dvc plots``), every prompt of the first
``prompts_sample`` questions per configuration (``paths.rag_prompts``) and one MLflow run per corpus × configuration
(plus one per swept trigger).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pandas as pd

from detectors.config.rag import references
from detectors.evaluation.plots import write_rag_curves
from detectors.evaluation.rag_metrics import evaluation_metrics
from detectors.evaluation.rag_report import (
    curves_table,
    headline,
    markdown_table,
    tuning_table,
    write_curves,
    write_prompts,
)
from detectors.evaluation.rag_sweep import curves as sweep_curves
from detectors.evaluation.rag_tracking import log_rag_runs
from detectors.evaluation.report import write_headline
from detectors.io import write_json
from detectors.rag.experiment import SWEEP, evaluation_rows, run_evaluation, shared_inputs
from pipelines._stage import run, stage_params

log = logging.getLogger("rag_eval")
READS = (
    "llm",
    "build_early.features.prompt",
    "build_early.stop",
    "build_realtime.spacy_model",
    "rag_eval",
    "${rag_eval.frameworks}",  # the section of every framework it runs
    "execution",
    "mlflow",
    "paths.llm",
    "paths.qa",
    "paths.registry",
    "paths.rag_index",
    "paths.rag_runs",
    "paths.rag_metrics",
    "paths.rag_headline",
    "paths.rag_table",
    "paths.rag_curves",
    "paths.rag_curves_plot",
    "paths.rag_prompts",
)
DEPS = (
    "${paths.llm}",
    "${paths.qa}",
    "${paths.registry}",
    "${paths.rag_index}",
    "${paths.index_report}",
)
OUTS = (
    ("${paths.rag_runs}", {"persist": True, "cache": False}, "finished questions: kept when a killed run restarts"),
    (
        "${paths.rag_metrics}",
        {"cache": False},
        "the detailed report: {corpus: {configuration: metrics}}, sweep, thresholds, digests",
    ),
    ("${paths.rag_table}", {"cache": False}),
    ("${paths.rag_curves}", {"cache": False}, "the sweep's curves: trigger, threshold, retrieval_rate, accuracy"),
    ("${paths.rag_prompts}", {"cache": False}),
)
METRICS = (
    (
        "${paths.rag_headline}",
        {"cache": False},
        "at a glance, one JSON per corpus: accuracy of DioR, the best other configuration, always, never",
    ),
)
PLOTS = (("${paths.rag_curves_plot}", {"cache": False}, "every trigger's accuracy vs retrieval-rate curve in one PNG"),)


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "rag_eval")
    rag = params["rag_eval"]
    rows = evaluation_rows(pd.read_parquet(params["paths.qa"]), rag)
    answers = {i: list(a) for i, a in zip(rows["test"]["id"], rows["test"]["answers"])}
    evaluation = run_evaluation(params, rows, shared_inputs(params))
    metrics = evaluation_metrics(evaluation.lines, evaluation.tuning, rag, answers)
    curves = sweep_curves(
        evaluation.sweep, list(evaluation.sweep_triggers), rag.bootstrap, rag.seed, evaluation.sweep_triggers
    )
    metrics[SWEEP] = {
        "corpus": rag.sweep.corpus,
        "query": rag.sweep.query,
        "curves": {t: c.summary() for t, c in curves.items()},
    }
    metrics["thresholds"] = evaluation.thresholds
    metrics["tuning"] = evaluation.tuning
    llm_name, llm_digest = evaluation.llm
    metrics["digests"] = {"llm": llm_digest, "corpora": evaluation.corpora}
    write_json(params["paths.rag_metrics"], metrics)
    table = {c: metrics[c] for c in rag.corpora}
    refs = references(rag.configurations)
    dior = [name for name, config in rag.configurations.items() if config.headline]  # its role, declared per row
    write_headline(params["paths.rag_headline"], headline(table, refs, dior))
    markdown = (
        markdown_table(table)
        + "\n"
        + tuning_table(evaluation.tuning, len(rows["val"]))
        + "\n"
        + curves_table(metrics[SWEEP])
    )
    Path(params["paths.rag_table"]).parent.mkdir(parents=True, exist_ok=True)
    Path(params["paths.rag_table"]).write_text(markdown, encoding="utf-8")
    log.info("RAG evaluation:\n%s", markdown)
    write_curves(params["paths.rag_curves"], curves)
    swept_on = f"sweep of corpus {rag.sweep.corpus}, query {rag.sweep.query}, {len(answers)} test questions"
    write_rag_curves(
        curves, Path(params["paths.rag_curves_plot"]), f"RAG: accuracy vs retrieval rate of every trigger ({swept_on})"
    )
    write_prompts(params["paths.rag_prompts"], evaluation.lines, rag.prompts_sample)
    configs = {name: dataclasses.asdict(c) for name, c in rag.configurations.items()}
    configs |= {
        name: {"triggers": [name], "query": name, **dataclasses.asdict(params[name])} for name in rag.frameworks
    }
    tags = {"llm": llm_name, "llm_digest": llm_digest}
    log_rag_runs(
        table,
        metrics[SWEEP],
        configs,
        rag.experiment,
        tags,
        params["mlflow"].artifact_root,
        metrics["digests"]["corpora"],
    )


if __name__ == "__main__":
    run(main)
