"""Stage register: log the early detector to MLflow, register it, move the champion alias if not worse."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlflow

from detectors import registry
from detectors.config import load_section
from detectors.early_detector import EarlyDetector
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("register")


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    train, evaluate = load_section("train_early", data=data), load_section("evaluate", data=data)
    params, mlflow_params = load_section("register_early", data=data), load_section("mlflow", data=data)
    detector = EarlyDetector.load(train.out_dir)
    test = json.loads(Path(evaluate.metrics).read_text())["gru"]
    val_auroc = float(detector.info["best_val_auroc"])
    registry.configure(mlflow_params)
    exp = registry.experiment(params.experiment, mlflow_params)
    metadata = {"llm": detector.fingerprint.to_dict(), "features": detector.groups, "threshold": detector.threshold}
    with mlflow.start_run(experiment_id=exp, run_name=params.name) as run:
        mlflow.log_params({"features": ",".join(detector.groups), "threshold": detector.threshold, "llm": detector.fingerprint.name})
        mlflow.log_metrics({"val_auroc": val_auroc, **{f"test_{k}": v for k, v in test.items() if k != "kind"}})
        info = registry.log_detector(train.out_dir, metadata)
        result = registry.register(info.model_uri, params.name, params.alias, val_auroc)
    result.update({"run_id": run.info.run_id, "model_uri": info.model_uri, "test_auroc": test["auroc"]})
    write_json(params.out, result)
    log.info("%s", result)


if __name__ == "__main__":
    main()
