"""The comparison in MLflow (minimal version; part f of issue 10 owns this module): one experiment per dataset,
one flat run per row of the long table, tagged ``detector``, ``kind``, ``level``, ``dataset`` and the base tags,
with the same ``test_*`` metric names, so that the runs table sorted by ``test_auroc`` is the comparison."""

from __future__ import annotations

import math
import numbers
from pathlib import Path

import mlflow
import pandas as pd

from detectors.registry import store

TAGS = ("scorer", "kind", "dataset", "level", "features", "delta_vs")


def log_comparison(
    table: pd.DataFrame, plots: dict[str, list[Path]], base_tags: dict[str, str], experiment_prefix: str, artifact_root: str
) -> None:
    """Log ``table`` (:data:`~detectors.evaluation.compare.COLUMNS`) to experiments ``<prefix>-<dataset>``; a run
    carries the figures of ``plots[<dataset>_<level>]`` and ``plots[<dataset>]``."""
    for dataset, rows in table.groupby("dataset", sort=True):
        exp = store.experiment(f"{experiment_prefix}-{dataset}", artifact_root)
        for row in rows.to_dict("records"):
            tags = {**base_tags, "detector": row["scorer"], "kind": row["kind"], "level": row["level"], "dataset": dataset}
            with mlflow.start_run(experiment_id=exp, run_name=f"{row['scorer']} · {row['level']}", tags=tags):
                mlflow.log_params({k: row[k] for k in TAGS if isinstance(row.get(k), str)})
                values = {f"test_{k}": float(v) for k, v in row.items() if isinstance(v, numbers.Real) and not math.isnan(v)}
                mlflow.log_metrics(values)
                for path in plots.get(f"{dataset}_{row['level']}", []) + plots.get(dataset, []):
                    mlflow.log_artifact(str(path))
