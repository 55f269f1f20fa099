"""Stage register_ctrla: log the CtrlA directions as MLflow models (``ctrla-honesty``, ``ctrla-confidence``),
register them, and move the champion alias only when the validation AUROC did not get worse.

Validation AUROC: the val split's true-vs-false statements for honesty (never the test split); the early set's validation split
(the monitor as a hallucination scorer) for confidence.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

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
        run_params = {"kind": cls.KIND, "layers": str(d.layers), "llm": d.fingerprint.name, "n_statements": d.config["n_statements"]}
        test = metrics["confidence_early"].get("test_auroc") if concept == "confidence" else None
        results[concept] = registry.log_and_register(
            directory, name, params.alias, exp, val_auroc, {} if test is None else {"test_auroc": test}, run_params, metadata
        )
        log.info("%s", results[concept])
    write_json(params.out, results)


if __name__ == "__main__":
    main()
