"""Stage register: log a trained detector to MLflow, register it, and apply the champion rule.

One stage per entry of ``register.detectors`` (``dvc.yaml``'s ``foreach``; ``--item NAME`` picks one, none runs them
all): the artifact at its ``artifact`` is registered under the entry's name, whatever its kind (DioR's early RNNs, the
real-time MLP, each corpus's utility trigger), with its test metrics (the object at ``keys`` in the JSON file
``metrics``: the evaluate stage's, or train_utility's). What sets a kind's versions apart, and which validation AUROC
they are compared by, the detector says itself (:meth:`~detectors.interfaces.Detector.registration`). Each version is
tagged with the digest of the validation records its AUROC was computed on (the ids its training kept in
``info["validation"]``, or the ``info["val_digest"]`` it recorded), so only comparable versions compete, and keeps its
validation scores: a version takes the champion alias only when it beats the champion's validation AUROC on the same
units by a paired 95 % bootstrap interval above 0 (:func:`detectors.evaluation.choice.versus`); otherwise it is
registered as the challenger. The run carries the choices training made (the real-time candidate, the utility
thresholds) as tags, and the single seeds' validation AUROC beside the registered detector's. Writes
``paths.registry/<name>.json``: the registration's result.

A new trained kind is registered by a ``register.detectors`` entry: nothing here names a kind.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from detectors.config.common import RegisteredDetector
from detectors.errors import InputError
from detectors.evaluation.choice import choice_tags, versus
from detectors.io import write_json
from detectors.registry import store
from detectors.registry.kinds import load_artifact
from pipelines._stage import run, stage_params

log = logging.getLogger("register")
READS = ("register", "mlflow", "paths.registry")
FOREACH = "register.detectors"  # one stage per registered detector: ${key} its name, ${item} its entry
DEPS = ("${item.artifact}", "${item.metrics}")
OUTS = (("${paths.registry}/${key}.json", {"cache": False}),)


def read_test_metrics(entry: RegisteredDetector, name: str) -> dict[str, Any]:
    """The test metrics of detector ``name``: the object at ``entry.keys`` in ``entry.metrics``; missing, a clear
    error naming the stage that writes them."""
    path = Path(entry.metrics)
    if not path.is_file():
        raise InputError(f"register.detectors.{name}.metrics = {entry.metrics!r}: no such file (run `dvc repro`)")
    value: Any = json.loads(path.read_text())
    for depth, key in enumerate(entry.keys):
        if not isinstance(value, dict) or key not in value:
            known = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise InputError(
                f"register.detectors.{name}.keys = {entry.keys}: {path} has no {key!r} under {entry.keys[:depth]} "
                f"(there: {known}); name the keys down to the detector's test metrics, or rerun the stage that "
                "writes them"
            )
        value = value[key]
    if not isinstance(value, dict) or "auroc" not in value:
        raise InputError(f"register.detectors.{name}: {path} at {entry.keys} holds no test metrics with an auroc")
    return value


def validation_digest(info: dict, artifact_dir: str | Path) -> str:
    """Digest of the records the detector's validation AUROC is computed on: the ``val_digest`` its training recorded,
    else the ids of its validation scores (``info["validation"]``)."""
    if info.get("val_digest"):
        return info["val_digest"]
    if info.get("validation"):
        return store.validation_digest(info["validation"]["ids"])
    raise InputError(
        f"the detector at {artifact_dir} records no validation records (info.val_digest, info.validation): its "
        "validation split has no ok record of both classes, or an older version trained it: check the val split and "
        "retrain it (`dvc repro`)"
    )


def artifact_dir(entry: RegisteredDetector, name: str) -> Path:
    """The trained artifact of ``name``; missing, a clear error."""
    path = Path(entry.artifact)
    if not (path / "detector.json").exists():
        beside = path.parent.iterdir() if path.parent.is_dir() else []
        trained = sorted(d.name for d in beside if (d / "detector.json").exists())
        raise InputError(
            f"register.detectors.{name}.artifact = {entry.artifact!r}: no trained detector there (trained beside it: "
            f"{trained}); name a trained artifact, or train it (`dvc repro`)"
        )
    return path


def register_detector(artifact: Path, test: dict, name: str, alias: str, experiment_id: str) -> dict:
    """Log ``artifact`` as a pyfunc, register it as ``name`` and apply the champion rule (the result, logged)."""
    detector = load_artifact(artifact)
    info, registration = detector.info, detector.registration()
    value = info.get(registration.val_key)
    val_auroc = float("nan") if value is None else float(value)  # no validation score: never the champion
    seeds = info.get("seeds", [info.get("seed")])
    metadata = {"llm": detector.fingerprint.to_dict(), "threshold": detector.threshold, **registration.params}
    run_params = {"threshold": detector.threshold, "llm": detector.fingerprint.name, "seeds": len(seeds)}
    test_metrics = {f"test_{k}": v for k, v in test.items() if isinstance(v, (int, float))}  # not kind, delta_vs
    seed_val = {f"seed_val_auroc_{s}": v for s, v in zip(seeds, info.get("seed_val_auroc", [])) if v is not None}
    tags = {"seeds": ",".join(map(str, seeds))} | choice_tags("choice.tokens", info.get("choice"))
    for threshold, record in (info.get("choices") or {}).items():
        tags |= choice_tags(f"choice.{threshold}", record)
    result = store.log_and_register(
        detector,
        artifact,
        name,
        alias,
        experiment_id,
        val_auroc,
        validation_digest(info, artifact),
        test_metrics | seed_val,
        run_params | registration.params,
        metadata,
        registration.features,
        info.get("validation"),
        versus,
        tags,
    )
    result["test_auroc"] = test["auroc"]
    log.info("%s", result)
    return result


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "register", FOREACH)
    register = params["register"]
    names = params.items or list(register.detectors)
    unknown = sorted(set(names) - set(register.detectors))
    if unknown:
        raise InputError(f"--item {unknown}: not in register.detectors ({sorted(register.detectors)})")
    store.configure(params["mlflow"].tracking_uri)  # an unreachable store: one line, before anything else
    # every artifact and its test metrics exist before anything is registered
    todo = {n: (artifact_dir(register.detectors[n], n), read_test_metrics(register.detectors[n], n)) for n in names}
    exp = store.experiment(register.experiment, params["mlflow"].artifact_root)
    for name, (artifact, test) in todo.items():
        result = register_detector(artifact, test, name, register.alias, exp)
        write_json(Path(params["paths.registry"]) / f"{name}.json", result)


if __name__ == "__main__":
    run(main)
