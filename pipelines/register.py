"""Stage register: log each DioR detector to MLflow, register it, and apply the champion rule.

``dior-early`` (the GRU) and ``dior-realtime`` (the MLP; its test metrics are the continuation level's). Each
version is tagged with the digest of the validation records its AUROC was computed on (the ok records of the
set's val split; for the real-time set those with entity tokens), so only comparable versions compete.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from detectors.interfaces import Level
from detectors.io import write_json
from detectors.registry import store
from detectors.registry.kinds import load_artifact
from pipelines._stage import run, stage_params

log = logging.getLogger("register")
READS = (
    "train_early.features", "build_realtime.hidden_layers", "register_early", "register_realtime", "mlflow",
    "paths.early", "paths.realtime", "paths.early_model", "paths.realtime_model",
    "paths.evaluate_early_metrics", "paths.evaluate_realtime_metrics",
    "paths.registry_early", "paths.registry_realtime",
)  # fmt: skip


def early_val_ids(path: str | Path) -> list[str]:
    """Ids of the early set's records the GRU's validation AUROC is computed on: the ok records of the val split."""
    frame = pd.read_parquet(path, columns=["id", "split", "status"])
    return frame.loc[(frame["status"] == "ok") & (frame["split"] == "val"), "id"].astype(str).tolist()


def realtime_val_ids(path: str | Path) -> list[str]:
    """Ids of the real-time set's records the MLP's validation AUROC is computed on: ok val records with entity tokens."""
    frame = pd.read_parquet(path, columns=["id", "split", "status", "token_label"])
    frame = frame[(frame["status"] == "ok") & (frame["split"] == "val")]
    return [str(i) for i, labels in zip(frame["id"], frame["token_label"]) if (np.asarray(labels) >= 0).any()]


def register_detector(artifact_dir: str, val_ids: list[str], test: dict, params, experiment_id: str, out: str, extra_params: dict) -> dict:
    """Log ``artifact_dir`` as a pyfunc, register it as ``params.name`` and apply the champion rule."""
    detector = load_artifact(artifact_dir)
    val_auroc = float(detector.info["best_val_auroc"])
    metadata = {"llm": detector.fingerprint.to_dict(), "threshold": detector.threshold, **extra_params}
    run_params = {"threshold": detector.threshold, "llm": detector.fingerprint.name, **extra_params}
    test_metrics = {f"test_{k}": v for k, v in test.items() if isinstance(v, (int, float))}  # not kind, delta_vs
    digest = store.validation_digest(val_ids)
    result = store.log_and_register(
        detector, artifact_dir, params.name, params.alias, experiment_id, val_auroc, digest, test_metrics, run_params, metadata
    )
    result["test_auroc"] = test["auroc"]
    write_json(out, result)
    log.info("%s", result)
    return result


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "register")
    mlflow_params = p["mlflow"]
    store.configure(mlflow_params.tracking_uri)
    early, realtime = p["register_early"], p["register_realtime"]
    early_test = json.loads(Path(p["paths.evaluate_early_metrics"]).read_text())[Level.QUESTION.value]["gru"]
    exp = store.experiment(early.experiment, mlflow_params.artifact_root)
    features = {"features": ",".join(p["train_early.features"])}
    register_detector(p["paths.early_model"], early_val_ids(p["paths.early"]), early_test, early, exp, p["paths.registry_early"], features)
    realtime_test = json.loads(Path(p["paths.evaluate_realtime_metrics"]).read_text())[Level.CONTINUATION.value]["mlp"]
    exp = store.experiment(realtime.experiment, mlflow_params.artifact_root)
    layers = ",".join(map(str, p["build_realtime.hidden_layers"]))
    register_detector(
        p["paths.realtime_model"], realtime_val_ids(p["paths.realtime"]), realtime_test, realtime, exp, p["paths.registry_realtime"],
        {"hidden_layers": layers},
    )


if __name__ == "__main__":
    run(main)
