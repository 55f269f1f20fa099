"""Stage register_ctrla: log the CtrlA directions as MLflow models (``ctrla-honesty``, ``ctrla-confidence``),
register them, and move the champion alias only when the validation AUROC did not get worse.

Validation AUROC: the val split's true-vs-false statements for honesty (never the test split); the early set's validation split
(the monitor as a hallucination scorer) for confidence.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlflow

from detectors import registry
from detectors.config import load_section
from detectors.ctrla import ConfidenceDetector, HonestySteering
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("register_ctrla")


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    extract, evaluate = load_section("extract_directions", data=data), load_section("evaluate_directions", data=data)
    params, mlflow_params = load_section("register_ctrla", data=data), load_section("mlflow", data=data)
    metrics = json.loads(Path(evaluate.metrics).read_text())
    val = {
        "honesty": (metrics.get("honesty") or {}).get("val_auroc_chosen_layers"),
        "confidence": metrics["confidence_early"].get("val_auroc"),
    }
    registry.configure(mlflow_params)
    exp = registry.experiment(params.experiment, mlflow_params)
    results = {}
    for concept, cls, name in (("honesty", HonestySteering, params.honesty_name), ("confidence", ConfidenceDetector, params.confidence_name)):
        directory = Path(extract.out_dir) / concept
        detector = cls.load(directory)  # refuses a malformed artifact before anything is logged
        d = detector.directions
        val_auroc = float(val[concept]) if val[concept] is not None else float("nan")
        metadata = {"llm": d.fingerprint.to_dict(), "kind": cls.KIND, "layers": d.layers}
        with mlflow.start_run(experiment_id=exp, run_name=name) as run:
            mlflow.log_params({"kind": cls.KIND, "layers": str(d.layers), "llm": d.fingerprint.name, "n_statements": d.config["n_statements"]})
            mlflow.log_metric("val_auroc", val_auroc)
            if concept == "confidence" and metrics["confidence_early"].get("test_auroc") is not None:
                mlflow.log_metric("test_auroc", metrics["confidence_early"]["test_auroc"])
            info = registry.log_detector(directory, metadata)
            result = registry.register(info.model_uri, name, params.alias, val_auroc)
        results[concept] = {**result, "run_id": run.info.run_id, "model_uri": info.model_uri}
        log.info("%s", results[concept])
    write_json(params.out, results)


if __name__ == "__main__":
    main()
