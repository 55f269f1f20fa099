"""Stage register: log each DioR detector to MLflow, register it, move its alias only if not worse.

``dior-early`` (the GRU) and ``dior-realtime`` (the MLP; its test metrics are the continuation level's).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from detectors.interfaces import Level
from detectors.io import write_json
from detectors.registry import store
from detectors.registry.kinds import load_artifact
from pipelines._stage import run, stage_params

log = logging.getLogger("register")
READS = (
    "train_early.features", "build_realtime.hidden_layers", "register_early", "register_realtime", "mlflow",
    "paths.early_model", "paths.realtime_model", "paths.evaluate_early_metrics", "paths.evaluate_realtime_metrics",
    "paths.registry_early", "paths.registry_realtime",
)  # fmt: skip


def register_detector(artifact_dir: str, test: dict, params, experiment_id: str, out: str, extra_params: dict) -> dict:
    """Log ``artifact_dir`` as a pyfunc, register it as ``params.name`` and apply the champion rule."""
    detector = load_artifact(artifact_dir)
    val_auroc = float(detector.info["best_val_auroc"])
    metadata = {"llm": detector.fingerprint.to_dict(), "threshold": detector.threshold, **extra_params}
    run_params = {"threshold": detector.threshold, "llm": detector.fingerprint.name, **extra_params}
    test_metrics = {f"test_{k}": v for k, v in test.items() if k != "kind"}
    result = store.log_and_register(artifact_dir, params.name, params.alias, experiment_id, val_auroc, test_metrics, run_params, metadata)
    result["test_auroc"] = test["auroc"]
    write_json(out, result)
    log.info("%s", result)
    return result


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "register")
    mlflow_params = p["mlflow"]
    store.configure(mlflow_params.tracking_uri)
    early, realtime = p["register_early"], p["register_realtime"]
    early_test = json.loads(Path(p["paths.evaluate_early_metrics"]).read_text())["gru"]
    exp = store.experiment(early.experiment, mlflow_params.artifact_root)
    register_detector(
        p["paths.early_model"], early_test, early, exp, p["paths.registry_early"], {"features": ",".join(p["train_early.features"])}
    )
    realtime_test = json.loads(Path(p["paths.evaluate_realtime_metrics"]).read_text())[Level.CONTINUATION.value]["mlp"]
    exp = store.experiment(realtime.experiment, mlflow_params.artifact_root)
    layers = ",".join(map(str, p["build_realtime.hidden_layers"]))
    register_detector(p["paths.realtime_model"], realtime_test, realtime, exp, p["paths.registry_realtime"], {"hidden_layers": layers})


if __name__ == "__main__":
    run(main)
