"""MLflow: tracking-store setup, logging and registering detectors, the champion-alias rule and promotion.

The champion rule: a new version takes the alias (``champion``) only when its validation AUROC is finite, it
was computed on the same validation set (``val_digest``: digest of the sorted validation record ids) with the
same LLM (``llm_digest``) as the champion's, from the same feature set (``features``, where the caller names one:
the early detectors), and it is not worse. A version that cannot be compared (no finite AUROC, another validation
set, LLM or feature set) gets the :data:`CHALLENGER` alias instead; a person promotes it with
:func:`promote` (``python -m detectors.registry.store promote NAME VERSION``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Iterable

import mlflow
from mlflow.tracking import MlflowClient

from detectors.config import load_section
from detectors.llm.fingerprint import Fingerprint
from detectors.registry.artifact import read_config
from detectors.registry.relocate import relocate, sqlite_path
from detectors.registry.requirements import pip_requirements

PYFUNC_MODEL = Path(__file__).with_name("pyfunc.py")
CHALLENGER = "challenger"
# MLflow 3's UI opens an experiment by its kind tag; without it, it infers a kind and may open the GenAI "Overview"
# page with no runs. The key and value are the UI's (mlflow/server/js bundle: ExperimentKind.CUSTOM_MODEL_DEVELOPMENT);
# the Python package has no constant for them (3.17).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
CUSTOM_MODEL_DEVELOPMENT = "custom_model_development"


def tracking_uri(uri: str, root: str | Path = ".") -> str:
    """The tracking URI with a relative sqlite path made absolute (stages and the UI then agree)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        db = (Path(root) / uri[len("sqlite:///"):]).resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db}"
    return uri


def configure(uri: str, root: str | Path = ".") -> str:
    """Point MLflow's tracking and registry at ``uri`` (relative sqlite paths resolved against ``root``).

    A sqlite store is anchored at its directory: opened from another place (the project was moved or
    cloned), its artifact locations are first re-mapped there (see :mod:`detectors.registry.relocate`).
    """
    uri = tracking_uri(uri, root)
    db = sqlite_path(uri)
    if db is not None:
        relocate(db)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def configure_params(params: str | Path = "params.yaml") -> str:
    """:func:`configure` with the ``mlflow`` section of a params file (a relative sqlite path is relative to it)."""
    params = Path(params)
    return configure(load_section("mlflow", params).tracking_uri, params.parent)


def artifact_location(name: str, artifact_root: str | Path | None, root: str | Path = ".") -> str | None:
    """Where experiment ``name`` keeps its artifacts: ``<artifact_root>/<name>`` (a directory, made absolute against
    ``root``, or an object-store URI such as ``s3://bucket/path``); None leaves it to the tracking server (its
    ``--artifacts-destination``, proxied as ``mlflow-artifacts:``)."""
    if artifact_root is None:
        return None
    if "://" in str(artifact_root):
        return f"{str(artifact_root).rstrip('/')}/{name}"
    location = (Path(root) / artifact_root / name).resolve()
    location.mkdir(parents=True, exist_ok=True)
    return location.as_uri()


def experiment(name: str, artifact_root: str | Path | None, root: str | Path = ".") -> str:
    """The id of experiment ``name``, created with its artifact location under ``artifact_root``
    (:func:`artifact_location`).

    The experiment is marked as custom model development (:data:`EXPERIMENT_KIND_TAG`), so the UI opens it on its
    runs table; an existing experiment without a kind (one an older version created) gets the mark too, one a person
    marked otherwise keeps theirs. Keep ``artifact_root`` inside the sqlite store's directory: only locations there
    move with the store."""
    found = mlflow.get_experiment_by_name(name)
    if found is None:
        tags = {EXPERIMENT_KIND_TAG: CUSTOM_MODEL_DEVELOPMENT}
        location = artifact_location(name, artifact_root, root)
        found = mlflow.get_experiment(mlflow.create_experiment(name, artifact_location=location, tags=tags))
        db = sqlite_path(mlflow.get_tracking_uri())
        if db is not None:  # a store MLflow has just created (configure found no tables to anchor) is anchored now
            relocate(db)
    elif EXPERIMENT_KIND_TAG not in found.tags:
        MlflowClient().set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, CUSTOM_MODEL_DEVELOPMENT)
    return found.experiment_id


def validation_digest(ids: Iterable[Any]) -> str:
    """Identity of a validation set: SHA-256 of its sorted record ids (one per line), shortened."""
    ids = sorted({str(i) for i in ids})
    if not ids:
        raise ValueError("a validation set with no record ids has no digest: the validation split is empty")
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def llm_digest(fingerprint: Fingerprint) -> str:
    """Identity of an LLM for the champion rule: the fingerprint fields that ``require_same`` compares."""
    keys = {k: getattr(fingerprint, k) for k in ("weights_digest", "hidden_size", "num_layers", "vocab_size")}
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def log_detector(detector: Any, artifact_dir: str | Path, metadata: dict[str, Any]) -> Any:
    """Log ``detector``'s directory as a models-from-code pyfunc (weights stay safetensors, no pickle), with the
    pip requirements its code and artifact need (:mod:`detectors.registry.requirements`)."""
    config = read_config(artifact_dir)
    return mlflow.pyfunc.log_model(
        name="model",
        python_model=str(PYFUNC_MODEL),
        artifacts={"detector": str(artifact_dir)},
        code_paths=[str(Path(__file__).parents[1])],  # the detectors package
        pip_requirements=pip_requirements(type(detector).__module__, config),
        metadata=metadata,
    )


def _number(value: str | None) -> float:
    try:
        return float(value) if value is not None else math.nan
    except ValueError:
        return math.nan


def decide(
    val_auroc: float, val_digest: str | None, llm: str, champion: Any | None, features: str | None = None
) -> tuple[str, str]:
    """``("champion" | "challenger" | "rejected", why)`` for a new version against the ``champion`` version.

    ``features`` (None: not compared) names what the detector reads; a champion with another or no feature set is
    another detector under the same name (e.g. ``dior-early`` before it became DioR's RNN over IG(Q) alone)."""
    if not math.isfinite(val_auroc):
        return CHALLENGER, f"validation AUROC is {val_auroc}: not comparable (e.g. a one-class validation split)"
    if val_digest is None:
        return CHALLENGER, "no validation set was recorded: not comparable"
    if champion is None:
        return "champion", "no champion yet"
    tags = champion.tags
    if tags.get("val_digest") != val_digest:
        return CHALLENGER, f"validation set {val_digest} differs from champion v{champion.version}'s {tags.get('val_digest')}"
    if tags.get("llm_digest") != llm:
        return CHALLENGER, f"LLM {llm} differs from champion v{champion.version}'s {tags.get('llm_digest')}"
    if features is not None and tags.get("features") != features:
        return CHALLENGER, f"feature set {features} differs from champion v{champion.version}'s {tags.get('features')}"
    current = _number(tags.get("val_auroc"))
    if not math.isfinite(current):
        return "champion", f"champion v{champion.version} has no finite validation AUROC"
    if val_auroc < current:
        return "rejected", f"validation AUROC {val_auroc:.4f} < champion v{champion.version}'s {current:.4f}"
    return "champion", f"validation AUROC {val_auroc:.4f} >= champion v{champion.version}'s {current:.4f}"


def alias_version(client: MlflowClient, name: str, alias: str) -> Any | None:
    """The version ``alias`` points to, or None when the model has no such alias; a store error is raised.

    Read from the registered model's alias map, not ``get_model_version_by_alias``: MLflow 3.17's sqlite store
    answers a missing alias with INVALID_PARAMETER_VALUE, the error code of a malformed request too."""
    version = client.get_registered_model(name).aliases.get(alias)
    return None if version is None else client.get_model_version(name, str(version))


def register(
    model_uri: str, name: str, alias: str, val_auroc: float, val_digest: str | None, llm: str, features: str | None = None
) -> dict[str, Any]:
    """Register a new version tagged with its validation AUROC, validation-set digest, LLM digest and feature set (when
    given), and apply the champion rule (:func:`decide`): the result says where ``alias`` points and why."""
    if alias == CHALLENGER:
        raise ValueError(f"alias {alias!r} is reserved for versions that cannot be compared; name another alias")
    client = MlflowClient()
    version = mlflow.register_model(model_uri, name)
    val_auroc = float(val_auroc)
    tags = {"val_auroc": repr(val_auroc), "val_digest": val_digest or "", "llm_digest": llm}
    tags |= {} if features is None else {"features": features}
    for key, value in tags.items():
        client.set_model_version_tag(name, version.version, key, value)
    current = alias_version(client, name, alias)
    decision, reason = decide(val_auroc, val_digest, llm, current, features)
    if decision != "rejected":
        client.set_registered_model_alias(name, alias if decision == "champion" else CHALLENGER, version.version)
    champion = version if decision == "champion" else current
    return {
        "name": name,
        "version": int(version.version),
        "alias": alias,
        "decision": decision,
        "reason": reason,
        "alias_moved": decision == "champion",
        "champion_version": None if champion is None else int(champion.version),
        "val_auroc": val_auroc if math.isfinite(val_auroc) else None,
        "val_digest": val_digest,
        "llm_digest": llm,
        "previous_champion_val_auroc": None if current is None else _number(current.tags.get("val_auroc")),
    }


def promote(name: str, version: int | str, alias: str = "champion") -> dict[str, Any]:
    """Move ``alias`` to ``version`` of model ``name`` (a person's decision, e.g. for a challenger evaluated on
    a new validation set); drops the challenger alias when it pointed there. Later versions compare with it."""
    client = MlflowClient()
    target = client.get_model_version(name, str(version))  # a missing version is an error naming it
    previous = alias_version(client, name, alias)
    client.set_registered_model_alias(name, alias, target.version)
    challenger = alias_version(client, name, CHALLENGER)
    if alias != CHALLENGER and challenger is not None and challenger.version == target.version:
        client.delete_registered_model_alias(name, CHALLENGER)
    before = None if previous is None else int(previous.version)
    return {"name": name, "version": int(target.version), "alias": alias, "previous_version": before}


def log_and_register(
    detector: Any,
    artifact_dir: str | Path,
    name: str,
    alias: str,
    experiment_id: str,
    val_auroc: float,
    val_digest: str | None,
    metrics: dict[str, float],
    params: dict[str, Any],
    metadata: dict[str, Any],
    features: str | None = None,
) -> dict[str, Any]:
    """One run that logs ``detector`` (a :class:`~detectors.interfaces.Detector` loaded from ``artifact_dir``)
    with its params and metrics, registers it as ``name`` and applies the champion rule (``features``: see
    :func:`decide`); returns :func:`register`'s result with the run id and model URI."""
    llm = llm_digest(detector.fingerprint)
    with mlflow.start_run(experiment_id=experiment_id, run_name=name) as run:
        mlflow.log_params(params)
        mlflow.log_metrics({k: v for k, v in {"val_auroc": val_auroc, **metrics}.items() if v is not None and math.isfinite(v)})
        mlflow.set_tags({"val_digest": val_digest or "", "llm_digest": llm})
        info = log_detector(detector, artifact_dir, metadata)
        result = register(info.model_uri, name, alias, val_auroc, val_digest, llm, features)
    return {**result, "run_id": run.info.run_id, "model_uri": info.model_uri}


def main(argv: list[str] | None = None) -> None:
    """``python -m detectors.registry.store promote NAME VERSION [--alias champion] [--params params.yaml | --tracking-uri URI]``"""
    parser = argparse.ArgumentParser(prog="python -m detectors.registry.store", description="Manage registered detectors.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("promote", help="move an alias (default: champion) to a version, e.g. a challenger")
    p.add_argument("name")
    p.add_argument("version", type=int)
    p.add_argument("--alias", default="champion")
    p.add_argument("--params", default="params.yaml", help="params file whose mlflow section names the store")
    p.add_argument("--tracking-uri", default=None, help="the store (default: the params file's mlflow.tracking_uri)")
    args = parser.parse_args(argv)
    if args.tracking_uri:
        configure(args.tracking_uri)
    else:
        configure_params(args.params)
    print(json.dumps(promote(args.name, args.version, args.alias)))


if __name__ == "__main__":
    main()
