"""Stage register: log each DioR detector to MLflow, register it, move its alias only if not worse.

``dior-early`` (the GRU) and ``dior-realtime`` (the MLP; its test metrics are the continuation level's).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from detectors import registry
from detectors.config import load_section
from detectors.mlflow_model import load_artifact
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("register")


def register_detector(artifact_dir: str, test: dict, params, mlflow_params, extra_params: dict) -> dict:
    """Log ``artifact_dir`` as a pyfunc, register it as ``params.name`` and apply the champion rule."""
    detector = load_artifact(artifact_dir)
    val_auroc = float(detector.info["best_val_auroc"])
    registry.configure(mlflow_params)
    exp = registry.experiment(params.experiment, mlflow_params)
    metadata = {"llm": detector.fingerprint.to_dict(), "threshold": detector.threshold, **extra_params}
    run_params = {"threshold": detector.threshold, "llm": detector.fingerprint.name, **extra_params}
    test_metrics = {f"test_{k}": v for k, v in test.items() if k != "kind"}
    result = registry.log_and_register(artifact_dir, params.name, params.alias, exp, val_auroc, test_metrics, run_params, metadata)
    result["test_auroc"] = test["auroc"]
    write_json(params.out, result)
    log.info("%s", result)
    return result


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    evaluate, mlflow_params = load_section("evaluate", data=data), load_section("mlflow", data=data)
    train_early, train_rt = load_section("train_early", data=data), load_section("train_realtime", data=data)
    early_test = json.loads(Path(evaluate.metrics).read_text())["gru"]
    register_detector(
        train_early.out_dir, early_test, load_section("register_early", data=data), mlflow_params,
        {"features": ",".join(train_early.features)},
    )  # fmt: skip
    realtime_test = json.loads(Path(evaluate.realtime_metrics).read_text())["sentence"]["mlp"]
    layers = load_section("build_realtime", data=data).hidden_layers
    register_detector(
        train_rt.out_dir, realtime_test, load_section("register_realtime", data=data), mlflow_params,
        {"hidden_layers": ",".join(map(str, layers))},
    )  # fmt: skip


if __name__ == "__main__":
    main()
