"""Stage register_ctrla: log the CtrlA directions as MLflow models (``ctrla-honesty``, ``ctrla-confidence``),
register them, and apply the champion rule.

Each artifact uses the layer range ``honesty_layers`` / ``confidence_layers`` names: ``paper`` (CtrlA's range
scaled to the LLM, as extracted) or ``validation`` (the window evaluate_directions kept on validation by the rule: the
paper's range unless a window beats it by a paired 95 % bootstrap interval above 0; the artifact's ``detector.json``
then records ``layer_selection``, the run the choice as tags). Validation AUROC at those layers: the val
split's true-vs-false statements for honesty (never the test split); the early set's validation split (the
monitor as a hallucination scorer) for confidence. evaluate_directions records the digest of the ids of each
(``val_digest``), so only versions evaluated on the same validation set compete, and the version keeps the val
scores at its layers: it becomes champion only when it beats the champion on them by the same rule. A range chosen on
validation has an optimistic validation AUROC; its test AUROC is logged beside it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from detectors.ctrla.registered import ConfidenceDetector, HonestySteering
from detectors.errors import InputError
from detectors.evaluation.choice import choice_tags, versus
from detectors.io import write_json
from detectors.registry import store
from pipelines._stage import run, stage_params

log = logging.getLogger("register_ctrla")
READS = ("register_ctrla", "mlflow", "paths.directions", "paths.evaluate_directions_metrics", "paths.registry")
DEPS = (
    "${paths.directions}",
    "${paths.evaluate_directions_metrics}",
)
OUTS = (("${paths.registry}/ctrla.json", {"cache": False}),)


def _section(metrics: dict, concept: str) -> dict:
    return metrics.get("honesty" if concept == "honesty" else "confidence_early") or {}


def window_choice(metrics: dict, concept: str) -> dict | None:
    """The rule's record of the layer window evaluate_directions kept for ``concept`` on validation (None: none)."""
    return _section(metrics, concept).get("ranges", {}).get("validation", {}).get("choice")


def chosen_range(metrics: dict, concept: str, selection: str) -> dict:
    """The layers, val and test AUROC (and val scores) that evaluate_directions reported for ``concept`` at the
    ``selection`` range."""
    found = _section(metrics, concept).get("ranges", {}).get(selection)
    if found is None and selection == "validation":
        raise InputError(
            f"register_ctrla.{concept}_layers = 'validation', but {concept} has no layer range chosen on validation "
            "in the "
            "evaluate_directions metrics (its validation split lacks one of the labels, or the metrics predate layer "
            "ranges): "
            "set it to 'paper' or rerun `dvc repro evaluate_directions`"
        )
    return found or {}


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "register_ctrla")
    registration, mlflow_params = params["register_ctrla"], params["mlflow"]
    metrics = json.loads(Path(params["paths.evaluate_directions_metrics"]).read_text())
    digests = {
        "honesty": (metrics.get("honesty") or {}).get("val_digest"),
        "confidence": metrics["confidence_early"].get("val_digest"),
    }
    store.configure(mlflow_params.tracking_uri)
    exp = store.experiment(registration.experiment, mlflow_params.artifact_root)
    results = {}
    concepts = (
        ("honesty", HonestySteering, registration.honesty_name, registration.honesty_layers),
        ("confidence", ConfidenceDetector, registration.confidence_name, registration.confidence_layers),
    )
    for concept, cls, name, selection in concepts:
        directory = Path(params["paths.directions"]) / concept
        detector = cls.load(directory)  # refuses a malformed artifact before anything is logged
        chosen = chosen_range(metrics, concept, selection)
        with tempfile.TemporaryDirectory() as tmp:
            if chosen.get("layers", detector.directions.layers) != detector.directions.layers:
                detector = cls(detector.directions.with_layers(chosen["layers"], selection))
                directory = detector.save(Path(tmp) / concept)
            d = detector.directions
            val_auroc = float(chosen["val_auroc"]) if chosen.get("val_auroc") is not None else float("nan")
            metadata = {"llm": d.fingerprint.to_dict(), "kind": cls.KIND, "layers": d.layers, "layer_range": selection}
            run_params = {
                "kind": cls.KIND,
                "layers": str(d.layers),
                "layer_range": selection,
                "llm": d.fingerprint.name,
                "n_statements": d.config["n_statements"],
            }
            test = chosen.get("test_auroc")
            results[concept] = store.log_and_register(
                detector,
                directory,
                name,
                registration.alias,
                exp,
                val_auroc,
                digests[concept],
                {} if test is None else {"test_auroc": test},
                run_params,
                metadata,
                validation=chosen.get("validation"),
                rule=versus,
                tags=choice_tags("choice.layers", window_choice(metrics, concept)),
            )
        results[concept]["layers"], results[concept]["layer_range"] = d.layers, selection
        log.info("%s", results[concept])
    write_json(Path(params["paths.registry"]) / "ctrla.json", results)


if __name__ == "__main__":
    run(main)
