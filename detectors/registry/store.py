"""MLflow: tracking-store setup, logging and registering detectors, and the champion-alias rule."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

PYFUNC_MODEL = Path(__file__).with_name("pyfunc.py")
REQUIREMENTS = (
    "torch", "transformers", "accelerate", "gguf", "captum", "safetensors", "numpy", "pandas", "pyyaml", "mlflow",
    "pytorch-lightning", "torchmetrics",
)  # fmt: skip


def tracking_uri(uri: str, root: str | Path = ".") -> str:
    """The tracking URI with a relative sqlite path made absolute (stages and the UI then agree)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        db = (Path(root) / uri[len("sqlite:///"):]).resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db}"
    return uri


def configure(uri: str, root: str | Path = ".") -> str:
    """Point MLflow's tracking and registry at ``uri`` (relative sqlite paths resolved against ``root``)."""
    uri = tracking_uri(uri, root)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def experiment(name: str, artifact_root: str | Path, root: str | Path = ".") -> str:
    """The id of experiment ``name``, created with an explicit artifact location under ``artifact_root``."""
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = (Path(root) / artifact_root / name).resolve()
    location.mkdir(parents=True, exist_ok=True)
    return mlflow.create_experiment(name, artifact_location=location.as_uri())


def pip_requirements() -> list[str]:
    """Pinned requirements of a logged detector, from the versions installed now."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in REQUIREMENTS]


def log_detector(artifact_dir: str | Path, metadata: dict[str, Any]) -> Any:
    """Log a detector directory as a models-from-code pyfunc (weights stay safetensors, no pickle)."""
    return mlflow.pyfunc.log_model(
        name="model",
        python_model=str(PYFUNC_MODEL),
        artifacts={"detector": str(artifact_dir)},
        code_paths=[str(Path(__file__).parents[1])],  # the detectors package
        pip_requirements=pip_requirements(),
        metadata=metadata,
    )


def register(model_uri: str, name: str, alias: str, val_auroc: float) -> dict[str, Any]:
    """Register a new version; move ``alias`` to it only if its validation AUROC is not worse."""
    client = MlflowClient()
    version = mlflow.register_model(model_uri, name)
    client.set_model_version_tag(name, version.version, "val_auroc", repr(float(val_auroc)))
    try:
        current = client.get_model_version_by_alias(name, alias)
        current_auroc = float(current.tags.get("val_auroc", "nan"))
    except mlflow.exceptions.MlflowException:
        current, current_auroc = None, float("-inf")
    moved = current is None or not (val_auroc < current_auroc)
    if moved:
        client.set_registered_model_alias(name, alias, version.version)
    champion = version.version if moved else current.version
    return {
        "name": name,
        "version": int(version.version),
        "alias": alias,
        "alias_moved": moved,
        "champion_version": int(champion),
        "val_auroc": val_auroc,
        "previous_champion_val_auroc": None if current is None else current_auroc,
    }


def log_and_register(
    artifact_dir: str | Path,
    name: str,
    alias: str,
    experiment_id: str,
    val_auroc: float,
    metrics: dict[str, float],
    params: dict[str, Any],
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """One run that logs a detector directory with its params and metrics, registers it as ``name``
    and applies the champion rule; returns :func:`register`'s result with the run id and model URI."""
    with mlflow.start_run(experiment_id=experiment_id, run_name=name) as run:
        mlflow.log_params(params)
        mlflow.log_metrics({"val_auroc": val_auroc, **metrics})
        info = log_detector(artifact_dir, metadata)
        result = register(info.model_uri, name, alias, val_auroc)
    return {**result, "run_id": run.info.run_id, "model_uri": info.model_uri}

