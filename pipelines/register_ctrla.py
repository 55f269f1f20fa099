"""Stage register_ctrla: log the CtrlA directions as MLflow models (``ctrla-honesty``, ``ctrla-confidence``),
register them, and apply the champion rule.

Validation AUROC: the val split's true-vs-false statements for honesty (never the test split); the early set's validation split
(the monitor as a hallucination scorer) for confidence. evaluate_directions records the digest of the ids of each (``val_digest``),
so only versions evaluated on the same validation set compete.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from detectors.ctrla.detectors import ConfidenceDetector, HonestySteering
from detectors.io import write_json
from detectors.registry import store
from pipelines._stage import run, stage_params

log = logging.getLogger("register_ctrla")
READS = ("register_ctrla", "mlflow", "paths.directions", "paths.evaluate_directions_metrics", "paths.registry_ctrla")


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "register_ctrla")
    params, mlflow_params = p["register_ctrla"], p["mlflow"]
    metrics = json.loads(Path(p["paths.evaluate_directions_metrics"]).read_text())
    honesty, confidence = metrics.get("honesty") or {}, metrics["confidence_early"]
    val = {"honesty": honesty.get("val_auroc_chosen_layers"), "confidence": confidence.get("val_auroc")}
    digests = {"honesty": honesty.get("val_digest"), "confidence": confidence.get("val_digest")}
    store.configure(mlflow_params.tracking_uri)
    exp = store.experiment(params.experiment, mlflow_params.artifact_root)
    results = {}
    for concept, cls, name in (("honesty", HonestySteering, params.honesty_name), ("confidence", ConfidenceDetector, params.confidence_name)):
        directory = Path(p["paths.directions"]) / concept
        detector = cls.load(directory)  # refuses a malformed artifact before anything is logged
        d = detector.directions
        val_auroc = float(val[concept]) if val[concept] is not None else float("nan")
        metadata = {"llm": d.fingerprint.to_dict(), "kind": cls.KIND, "layers": d.layers}
        run_params = {"kind": cls.KIND, "layers": str(d.layers), "llm": d.fingerprint.name, "n_statements": d.config["n_statements"]}
        test = metrics["confidence_early"].get("test_auroc") if concept == "confidence" else None
        results[concept] = store.log_and_register(
            detector, directory, name, params.alias, exp, val_auroc, digests[concept], {} if test is None else {"test_auroc": test},
            run_params, metadata,
        )  # fmt: skip
        log.info("%s", results[concept])
    write_json(p["paths.registry_ctrla"], results)


if __name__ == "__main__":
    run(main)
