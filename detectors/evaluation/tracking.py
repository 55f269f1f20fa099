"""The comparison in MLflow: one experiment per dataset (``<prefix>-early``, ``<prefix>-realtime``), one FLAT run per
row of the long comparison table, so that the experiment's runs table sorted by ``test_auroc`` is the comparison.
The table (built by the evaluate stage) has one row per scorer × dataset × level with columns ``scorer, kind, dataset,
level, features, auroc, auroc_ci_low, auroc_ci_high, auprc, accuracy, f1, ece, threshold, trigger_rate, n,
positive_rate`` and, for trained detectors, ``delta_auroc, delta_ci_low, delta_ci_high, delta_vs``.

Every run is named ``"<scorer> · <level>"``, tagged ``detector`` (the scorer), ``kind`` (detector | trained baseline |
baseline), ``level``, ``dataset``, ``llm`` (+ the caller's base tags, ``delta_vs`` for trained detectors and
``comparison``, the id of one logging), has params ``scorer`` and ``features``, and metrics with the same names in every
run (:data:`METRICS`; a value the row lacks, e.g. a baseline's ``delta_auroc``, is left out rather than logged as NaN).

Plots: each run carries, under ``plots/``, the figures it appears in: ``plots[dataset]`` (figures of the whole set)
and ``plots[f"{dataset}_{level}"]`` (its level's ROC, precision-recall, ECDF and reliability figures). A user who
opens a run sees its curves beside the others'; the cost is a copy of a few small PNGs per run.

Re-running replaces: the runs of an earlier logging of the same dataset are soft-deleted once the new ones are
logged, so the runs table never shows two rows for one scorer × level. Deleted runs stay restorable (the UI's
"Deleted" state filter) until ``mlflow gc`` purges them; the history of the numbers is in git (``dvc metrics``).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import mlflow
import pandas as pd
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from detectors.evaluation.choice import choice_tags
from detectors.evaluation.compare import DATASETS, KINDS
from detectors.interfaces import Level
from detectors.registry import store

TEXT = ("scorer", "kind", "dataset", "level", "features", "delta_vs")
REQUIRED = (*TEXT[:-1], "auroc")
LEVELS = tuple(level.value for level in Level)
# table column → metric name; test-split metrics carry ``test_``, the validation threshold, the trigger rate at it and
# the paired difference to the best baseline keep their names. Other numeric columns are logged under their own name.
METRICS = {
    **{
        c: f"test_{c}"
        for c in ("auroc", "auroc_ci_low", "auroc_ci_high", "auprc", "accuracy", "f1", "ece", "n", "positive_rate")
    },
    **{c: c for c in ("threshold", "trigger_rate", "delta_auroc", "delta_ci_low", "delta_ci_high")},
}
# The UI shows no metric column by default (3.17: Source, Models, Dataset) and keeps a user's column choice in the
# browser. A shared view (experiment tag ``mlflow.sharedViewState.<key>``, opened with ``?viewStateShareKey=<key>``, see
# :func:`view_url`) gives everyone the comparison: sorted by test_auroc, with the level, kind and metric columns.
VIEW_KEY = "comparison"
VIEW_COLUMNS = (
    ("tags.`level`", "tags.`kind`")
    + tuple(
        f"metrics.`{m}`"
        for m in (
            "test_auroc",
            "test_auroc_ci_low",
            "test_auroc_ci_high",
            "delta_auroc",
            "delta_ci_low",
            "delta_ci_high",
            "test_auprc",
            "test_f1",
            "test_ece",
            "trigger_rate",
            "test_n",
            "seed_auroc_min",
            "seed_auroc_max",
            "seed_auroc_sd",
        )
    )
    + ("tags.`delta_vs`",)
)
VIEW = {
    "orderByKey": "metrics.`test_auroc`",
    "orderByAsc": False,
    "selectedColumns": list(VIEW_COLUMNS),
    "columnOrder": list(VIEW_COLUMNS),
}
DESCRIPTION = (
    "One run per scorer × level on the {dataset} test set, logged by the `evaluate` stage. Sort the runs table by "
    "`test_auroc`; `test_auroc_ci_low`/`_high` are its 95 % bootstrap interval, `delta_auroc` (with "
    "`delta_ci_low`/`_high`) "
    "a trained detector's AUROC minus the best training-free baseline's (`delta_vs`) on the same examples, "
    "`trigger_rate` "
    "the share of test units at or above the threshold chosen on validation, `seed_auroc_min`/`_max`/`_sd` the test "
    "AUROC of a trained detector's single seeds (each net of its seed ensemble alone). Filter e.g. `tags.level = "
    "'continuation'`. "
    "The comparison view shows these columns: add `?viewStateShareKey=comparison` to this page's address."
)


def _check(table: pd.DataFrame, plots: dict[str, list[Path]], base_tags: dict[str, str]) -> None:
    missing = [c for c in REQUIRED if c not in table.columns]
    if missing:
        raise ValueError(
            f"comparison table lacks columns {missing}: log_comparison expects the long table (a row per scorer × "
            f"level)"
        )
    if table.empty:
        raise ValueError("comparison table has no rows: nothing to log (did the evaluation score any unit?)")
    for column, allowed in (("dataset", DATASETS), ("level", LEVELS), ("kind", KINDS)):
        bad = sorted(set(table[column].astype(str)) - set(allowed))
        if bad:
            raise ValueError(f"comparison table column {column!r} has values {bad}; allowed: {list(allowed)}")
    duplicated = table[table.duplicated(["scorer", "dataset", "level"], keep=False)]
    if not duplicated.empty:
        rows = sorted(set(duplicated[["scorer", "dataset", "level"]].itertuples(index=False, name=None)))
        raise ValueError(
            f"comparison table has several rows for (scorer, dataset, level) {rows}: one run each is logged"
        )
    if not str(base_tags.get("llm", "")).strip():
        raise ValueError(
            "base_tags lacks 'llm' (the LLM's name): every comparison run is tagged with the LLM it scored"
        )
    keys = {d for d in table["dataset"]} | {f"{d}_{lv}" for d, lv in zip(table["dataset"], table["level"])}
    unknown = sorted(set(plots) - keys)
    if unknown:
        raise ValueError(
            f"plots keys {unknown} name no dataset or <dataset>_<level> of the table; use one of {sorted(keys)}"
        )
    absent = [str(p) for paths in plots.values() for p in paths if not Path(p).is_file()]
    if absent:
        raise FileNotFoundError(f"plots to log do not exist: {absent}")


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def run_metrics(row: dict) -> dict[str, float]:
    """The metrics of one table row under their MLflow names (:data:`METRICS`; other numeric columns as they are);
    missing or non-finite values are left out."""
    out = {}
    for column, value in row.items():
        if column in TEXT or isinstance(value, (str, bool)):
            continue
        number = _number(value)
        if number is not None:
            out[METRICS.get(column, column)] = number
    return out


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def log_comparison(
    table: pd.DataFrame,
    plots: dict[str, list[Path]],
    base_tags: dict[str, str],
    experiment_prefix: str,
    artifact_root: str | None,
) -> None:
    """Log ``table`` (the long comparison table) as one flat run per row in experiment
    ``f"{experiment_prefix}-{dataset}"`` (created under ``artifact_root``, see
    :func:`~detectors.registry.store.experiment`),
    then soft-delete the runs an earlier logging left for the same dataset. ``plots`` maps ``dataset`` or
    ``f"{dataset}_{level}"`` to the PNGs each run of that dataset (or dataset × level) carries; ``base_tags`` must name
    the ``llm``. Bad input (missing columns, unknown datasets, levels or kinds, duplicate rows, unknown plot keys,
    missing files) is refused before anything is logged."""
    _check(table, plots, base_tags)
    client = MlflowClient()
    comparison = uuid.uuid4().hex[:12]
    for dataset, rows in table.groupby("dataset", sort=True):
        exp = store.experiment(f"{experiment_prefix}-{dataset}", artifact_root)
        client.set_experiment_tag(exp, "mlflow.note.content", DESCRIPTION.format(dataset=dataset))
        client.set_experiment_tag(exp, f"mlflow.sharedViewState.{VIEW_KEY}", json.dumps(VIEW))
        new = set()
        for row in rows.sort_values(["level", "scorer"]).to_dict("records"):
            tags = {
                **base_tags,
                "detector": str(row["scorer"]),
                "kind": str(row["kind"]),
                "level": str(row["level"]),
                "dataset": str(dataset),
                "comparison": comparison,
            }
            if _text(row.get("delta_vs")):
                tags["delta_vs"] = _text(row["delta_vs"])
            with mlflow.start_run(experiment_id=exp, run_name=f"{row['scorer']} · {row['level']}", tags=tags) as run:
                mlflow.log_params({"scorer": str(row["scorer"]), "features": _text(row["features"])})
                mlflow.log_metrics(run_metrics(row))
                for path in list(plots.get(str(dataset), [])) + list(plots.get(f"{dataset}_{row['level']}", [])):
                    mlflow.log_artifact(str(path), artifact_path="plots")
            new.add(run.info.run_id)
        for old in client.search_runs([exp], f"tags.dataset = '{dataset}'", ViewType.ACTIVE_ONLY, max_results=50000):
            if old.info.run_id not in new:
                client.delete_run(old.info.run_id)


def view_url(server: str, experiment_id: str) -> str:
    """The address of an experiment's comparison view (runs table sorted by test_auroc, metric columns shown) on the
    MLflow server at ``server`` (e.g. ``http://127.0.0.1:5000``)."""
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}"


def log_directions(
    metrics: dict,
    pngs: list[Path],
    tags: dict[str, str],
    params: dict[str, object],
    experiment: str,
    artifact_root: str | None,
) -> str:
    """One MLflow run for the CtrlA directions (evaluate_directions): ``params`` and the chosen layer ranges as params,
    the rule's choice of each validation window as tags (``<concept>_layers.choice.*``: chosen, default, ties, ...),
    every range's metrics (:func:`flat_metrics`), the honesty AUROC per layer and the TruthfulQA accuracy per λ as
    steps, the plots as artifacts. Returns the run's id."""
    exp = store.experiment(experiment, artifact_root)
    for concept, section in (("honesty", metrics.get("honesty", {})), ("confidence", metrics["confidence_early"])):
        record = section.get("ranges", {}).get("validation", {}).get("choice")
        tags = {**tags, **choice_tags(f"{concept}_layers.choice", record)}
    with mlflow.start_run(experiment_id=exp, run_name="ctrla directions", tags=tags) as run:
        mlflow.log_params(params)
        mlflow.log_params(
            {
                f"{concept}_{name}_layers": str(r["layers"])
                for concept, section in (("honesty", metrics["honesty"]), ("confidence", metrics["confidence_early"]))
                for name, r in section.get("ranges", {}).items()
            }
        )
        mlflow.log_metrics(flat_metrics(metrics))
        for i, a in enumerate(metrics["honesty"].get("auroc_per_layer", []), 1):
            if a is not None:
                mlflow.log_metric("honesty_auroc_by_layer", a, step=i)
        for lam, acc in metrics.get("truthfulqa", {}).get("accuracy", {}).items():
            mlflow.log_metric("truthfulqa_accuracy", acc, step=int(round(float(lam) * 1000)))
        for path in pngs:
            mlflow.log_artifact(str(path))
    return run.info.run_id


def flat_metrics(metrics: dict) -> dict[str, float]:
    """MLflow's flat view of the ranges: ``<concept>_<range>_<metric>`` (e.g. ``confidence_validation_test_auroc``)."""
    sections = {
        "honesty": metrics.get("honesty", {}),
        "confidence": metrics["confidence_early"],
        "confidence_realtime": metrics.get("confidence_realtime", {}),
    }
    return {
        f"{concept}_{name}_{key}": value
        for concept, section in sections.items()
        for name, r in section.get("ranges", {}).items()
        for key, value in r.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
