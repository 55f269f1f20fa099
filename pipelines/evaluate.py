"""Stage evaluate: one comparison of every scorer on the test splits, the same way.

Early set (question level): every trained early detector (one directory each under ``paths.early_model``)
beside the question baselines (the logistic probe, fitted on the train split, listed apart as a trained baseline).
Real-time set: the MLP beside the training-free token baselines at token, entity and continuation level (the
catalog's, and every training-free RAG trigger's offline score). Other
stages' per-id score tables (CtrlA's confidence, RIND, RetroRAG's evaluator on the LLM's own answer) are joined by id
when they exist. Every score is a
:class:`~detectors.interfaces.Scorer` compared by :func:`detectors.evaluation.compare.compare`, with clustered
bootstrap intervals and, for trained detectors, the paired difference from the best training-free baseline and the
spread of their single seeds' test AUROC (a seed ensemble's members scored alone). Writes the detailed
reports (``{level: {scorer: metrics}}`` per dataset), their headline (``dvc metrics``: one file per dataset x level,
the best trained detector's and the best baseline's test AUROC), the long table (parquet) and its Markdown, the
figures (``dvc plots``: ROC, precision-recall, reliability, score ECDFs, DioR Fig. 7; their curves as CSVs) and one
flat MLflow run per table row.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
from safetensors.numpy import load_file

from detectors.baselines.catalog import question_baselines, realtime_baselines
from detectors.dior.early_detector import load_early_detectors
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.dior.served import served_behaviour, served_scorer
from detectors.evaluation.compare import DATASETS, compare_levels, long_table
from detectors.evaluation.inputs import join_score_tables
from detectors.evaluation.plots import write_comparison_plots
from detectors.evaluation.report import headline, markdown_table, nested_metrics, write_headline
from detectors.evaluation.scorers import DetectorScorer, realtime_detector_scorer, seed_stat
from detectors.evaluation.tracking import log_comparison
from detectors.evaluation.units import realtime_token_stats, realtime_units
from detectors.interfaces import Level
from detectors.io import file_digest, write_json
from detectors.rag.families import trigger_scorers
from detectors.registry import store
from pipelines._stage import run, stage_params

log = logging.getLogger("evaluate")
READS = (
    "train_early.training.threshold",
    "train_realtime.training.threshold",
    "evaluate",
    "mlflow",
    "paths.early",
    "paths.early_model",
    "paths.realtime",
    "paths.realtime_hidden",
    "paths.realtime_model",
    "paths.ctrla_early",
    "paths.ctrla_realtime",
    "paths.baselines_early",
    "paths.baselines_realtime",
    "paths.early_scores",
    "paths.realtime_scores",
    "paths.evaluate_early_metrics",
    "paths.evaluate_realtime_metrics",
    "paths.evaluate_headline",
    "paths.comparison",
    "paths.comparison_table",
    "paths.served_metrics",
    "paths.plots",
)
DEPS = (
    "${paths.early}",
    "${paths.early_model}",
    "${paths.realtime}",
    "${paths.realtime_hidden}",
    "${paths.realtime_model}",
    "${paths.ctrla_early}",
    "${paths.ctrla_realtime}",
    "${paths.baselines_early}",
    "${paths.baselines_realtime}",
)
OUTS = (
    "${paths.early_scores}",
    "${paths.realtime_scores}",
    "${paths.comparison}",
    (
        "${paths.comparison_table}",
        {"cache": False},
        "the Markdown comparison: a results page under docs/results (git-tracked)",
    ),
    (
        "${paths.evaluate_early_metrics}",
        {"cache": False},
        "detailed reports {level: {scorer: metrics}} (register reads them)",
    ),
    ("${paths.evaluate_realtime_metrics}", {"cache": False}),
    ("${paths.plots}/roc", {"cache": False}, "the curves' numbers behind the figures: <dataset>_<level>/<scorer>.csv"),
    ("${paths.plots}/pr", {"cache": False}),
    ("${paths.plots}/reliability", {"cache": False}),
    ("${paths.plots}/early_entropy_ecdf", {"cache": False}, "correct.csv, hallucinated.csv"),
    ("${paths.served_metrics}", {"cache": False}),
)
METRICS = (
    (
        "${paths.evaluate_headline}",
        {"cache": False},
        "at a glance, one JSON per dataset x level: best detector's and best baseline's test AUROC",
    ),
)
PLOTS = (
    (
        "${paths.plots}/figures",
        {"cache": False},
        "PNGs, every scorer in one figure: <dataset>_<level>_{curves,ecdf}.png, early_entropy_ecdf.png",
    ),
)


def early_inputs(params) -> tuple[pd.DataFrame, dict, dict]:
    """The early set joined with the question-level score tables, its units and its scorers (by level)."""
    frame, _ = join_score_tables(
        pd.read_parquet(params["paths.early"]),
        {"CtrlA": params["paths.ctrla_early"], "baselines": params["paths.baselines_early"]},
    )
    # every trained early detector under paths.early_model (dior-early, dior-early-extended, ablations), named after its
    # directory
    trained = [
        DetectorScorer.with_seeds(name, det) for name, det in load_early_detectors(params["paths.early_model"]).items()
    ]
    scorers = trained + question_baselines(set(frame.columns))
    return frame, {Level.QUESTION: frame}, {Level.QUESTION: scorers}


def realtime_inputs(params) -> tuple[pd.DataFrame, dict, dict]:
    """The real-time set joined with the per-token score tables, its token/entity/continuation units and the
    scorers of each level; every list-valued joined column is a per-token statistic of its name."""
    tables = {"CtrlA": params["paths.ctrla_realtime"], "baselines": params["paths.baselines_realtime"]}
    frame, joined = join_score_tables(pd.read_parquet(params["paths.realtime"]), tables)
    detector = RealtimeDetector.load(params["paths.realtime_model"])
    hidden = load_file(params["paths.realtime_hidden"])["hidden"]
    mlp = detector.record_scores(frame, hidden)
    seeds = tuple(detector.info.get("seeds", [])) if detector.per_seed() else ()
    single = {seed_stat("mlp", s): d.record_scores(frame, hidden) for s, d in zip(seeds, detector.per_seed())}
    stats = realtime_token_stats(frame, mlp, joined, single)
    units = realtime_units(frame, stats)
    names = set().union(*(s.keys() for s in stats.values())) - set(single)
    baselines = {level: realtime_baselines(level, names) for level in units}
    baselines = {level: listed + trigger_scorers(level, names, listed) for level, listed in baselines.items()}
    scorers = {level: [realtime_detector_scorer(level, seeds=seeds)] + baselines[level] for level in units}
    # what monitor() does: the max over every token
    scorers[Level.CONTINUATION].insert(1, served_scorer(detector.threshold, seeds))
    served = served_behaviour(frame, mlp, detector.threshold) | {"tokens": detector.info.get("tokens")}
    write_json(params["paths.served_metrics"], served)
    log.info("served real-time detector on the test split: %s", served)
    return frame, units, scorers


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "evaluate")
    evaluation, mlflow_params = params["evaluate"], params["mlflow"]
    inputs = {"early": early_inputs(params), "realtime": realtime_inputs(params)}
    strategy = {
        "early": params["train_early.training.threshold"],
        "realtime": params["train_realtime.training.threshold"],
    }
    tables, scores, probabilities = [], {}, {}
    for dataset, (_, units, scorers) in inputs.items():
        results, scores[dataset], probabilities[dataset] = compare_levels(
            units, scorers, strategy[dataset], evaluation.ece_bins, evaluation.bootstrap, evaluation.seed
        )
        Path(params[f"paths.{dataset}_scores"]).parent.mkdir(parents=True, exist_ok=True)
        scores[dataset].to_parquet(params[f"paths.{dataset}_scores"], index=False)
        tables.append(long_table(results, [s for level in scorers.values() for s in level], dataset))
    table = pd.concat(tables, ignore_index=True)
    for dataset in DATASETS:
        write_json(params[f"paths.evaluate_{dataset}_metrics"], nested_metrics(table, dataset))
    write_headline(params["paths.evaluate_headline"], headline(table))
    Path(params["paths.comparison"]).parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(params["paths.comparison"], index=False)
    markdown = markdown_table(table)
    Path(params["paths.comparison_table"]).parent.mkdir(parents=True, exist_ok=True)
    Path(params["paths.comparison_table"]).write_text(markdown + "\n", encoding="utf-8")
    log.info("comparison:\n%s", markdown)
    plots = write_comparison_plots(
        table, scores, probabilities, inputs["early"][0], Path(params["paths.plots"]), evaluation.ece_bins
    )

    store.configure(mlflow_params.tracking_uri)
    fingerprint = inputs["early"][2][Level.QUESTION][0].detector.fingerprint
    data = {f"{d}_data": file_digest(params[f"paths.{d}"]) for d in DATASETS}
    tags = {"llm": fingerprint.name, "llm_digest": fingerprint.weights_digest, **data}
    log_comparison(table, plots, tags, evaluation.experiment, mlflow_params.artifact_root)


if __name__ == "__main__":
    run(main)
