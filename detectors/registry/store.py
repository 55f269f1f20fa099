"""MLflow: tracking-store setup, logging and registering detectors, the champion-alias rule and promotion.

The champion rule: a new version takes the alias (``champion``) only when its validation AUROC is finite, it
was computed on the same validation set (``val_digest``: digest of the sorted validation record ids) with the
same LLM (``llm_digest``) as the champion's, from the same feature set (``features``, where the caller names one:
the early detectors), and it beats the champion by the rule every validation choice follows
(:mod:`detectors.evaluation.choice`): the paired 95 % bootstrap interval of its validation AUROC minus the champion's,
on the same validation units, lies above 0. Each version keeps its validation scores (``validation``:
:func:`~detectors.evaluation.choice.scored_units`, a JSON artifact of its run named by the version's
``validation_scores`` tag) so that a later version is compared with it unit by unit; the caller hands the rule in
(``rule``: :func:`detectors.evaluation.choice.versus`, which the register stages pass; the registry sits below
evaluation and does not import it). A version level with the champion,
worse, or that cannot be compared (no finite AUROC, another validation set, LLM or feature set, no validation scores)
gets the :data:`CHALLENGER` alias instead; a person promotes it with :func:`promote` (``dynrag promote NAME VERSION``,
or ``python -m detectors.registry.store promote NAME VERSION``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from detectors.config.common import URI_SCHEME, store_uri_problem
from detectors.errors import InputError
from detectors.llm.fingerprint import Fingerprint
from detectors.registry.artifact import ArtifactIntegrityError, read_config
from detectors.registry.relocate import anchor, require_in_place, require_sound, sqlite_path
from detectors.registry.requirements import pip_requirements

PYFUNC_MODEL = Path(__file__).with_name("pyfunc.py")
CHALLENGER = "challenger"
# MLflow 3's UI opens an experiment by its kind tag; without it, it infers a kind and may open the GenAI "Overview"
# page with no runs. The key and value are the UI's (mlflow/server/js bundle: ExperimentKind.CUSTOM_MODEL_DEVELOPMENT);
# the Python package has no constant for them (3.17).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
CUSTOM_MODEL_DEVELOPMENT = "custom_model_development"
HEALTH_TIMEOUT_S = 5.0  # a tracking server that has not answered /health by then is reported, not retried for minutes


class TrackingServerError(InputError):
    """The tracking URI names a server that does not answer, or answers as no MLflow server does."""


class StoreNotNamedError(InputError):
    """No tracking store was named (no tracking URI given and no ``$MLFLOW_TRACKING_URI``)."""


class StoreNotFoundError(InputError):
    """A reader named a sqlite store that does not exist."""


class NotRegisteredError(InputError, LookupError):
    """No registered model, version or alias of that name in the store."""


class TrackingURIError(InputError):
    """A tracking URI that names no store the project uses (a plain path, a ``file:`` URI)."""


# what to do about a registered version that cannot be served: the stage that registers it (forced: the store is not a
# DVC output, so nothing else makes it run), or another version
REREGISTER = "re-register it (`dvc repro -f -s {stage}`), or promote another version (`dynrag promote {name} VERSION`)"


def tracking_uri(uri: str, root: str | Path = ".", mkdir: bool = True) -> str:
    """The tracking URI with a relative sqlite path made absolute (stages and the UI then agree); ``mkdir``: create the
    database's directory (a writer's first run). A URI that names no store the project uses (a plain path, which MLflow
    would take for its deprecated file store: :func:`~detectors.config.common.store_uri_problem`) is a
    :class:`TrackingURIError` that gives the ``sqlite:///`` form to use."""
    problem = store_uri_problem(uri, root)
    if problem is not None:
        raise TrackingURIError(f"tracking URI {uri!r} is {problem}")
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        db = (Path(root) / uri[len("sqlite:///") :]).resolve()
        if mkdir:
            db.parent.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{db}"
    return uri


def check_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """For an ``http(s)://`` tracking URI: GET its ``/health`` once (MLflow's HTTP client, so its TLS and auth settings
    apply; no retries, ``timeout`` seconds), and raise :class:`TrackingServerError` naming the URI unless an MLflow
    server answers. MLflow's own calls would retry for minutes and then fail with a bare 404 or connection traceback."""
    if not uri.startswith(("http://", "https://")):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    fix = (
        "start it (`mlflow server ...`), or name a running one in params.yaml's mlflow.tracking_uri, --tracking-uri "
        "or $MLFLOW_TRACKING_URI"
    )
    try:
        response = http_request(
            get_default_host_creds(uri), "/health", "GET", max_retries=0, timeout=timeout, raise_on_status=False
        )
    except MlflowException as err:
        found = re.search(r"\[Errno -?\d+\] [^'\")]+|Read timed out|timed out", str(err))
        reason = found.group(0) if found else type(err.__cause__ or err).__name__
        raise TrackingServerError(
            f"no MLflow tracking server answers at {uri} ({reason.strip()}, {timeout:g} s timeout): {fix}"
        ) from None
    if response.status_code >= 400 and response.status_code not in (401, 403):  # a server asking for credentials is one
        raise TrackingServerError(
            f"{uri} answered HTTP {response.status_code} to GET /health: no MLflow tracking server is there; {fix}"
        )


def configure(uri: str, root: str | Path = ".", *, existing: bool = False) -> str:
    """Point MLflow's tracking and registry at ``uri`` (relative sqlite paths resolved against ``root``); returns the
    URI.

    Never writes to the store. A tracking server must answer its health check (:func:`check_server`); a sqlite file
    that is empty, malformed or holds no MLflow store is refused (:func:`~detectors.registry.relocate.require_sound`),
    never initialised; a sqlite store opened from another directory than the one it records (moved or cloned) is
    refused with the command that relocates it (see :mod:`detectors.registry.relocate`), since its artifact locations
    still point to the old directory. ``existing`` (readers): a sqlite database that does not exist is an error, not a
    new empty store MLflow would create.
    """
    uri = tracking_uri(uri, root, mkdir=not existing)
    check_server(uri)
    db = sqlite_path(uri)
    if existing and db is not None and not db.exists():
        raise StoreNotFoundError(
            f"no MLflow store at {db}: check the tracking URI (a relative sqlite path is relative to the project "
            "root), or run `dvc repro` to create and fill it"
        )
    if db is not None and db.exists():
        require_sound(db)
    require_in_place(uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


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
    marked otherwise keeps theirs. A sqlite store that records no directory yet records its own (see
    :mod:`detectors.registry.relocate`). Keep ``artifact_root`` inside the sqlite store's directory: only locations
    there
    move with the store."""
    found = mlflow.get_experiment_by_name(name)
    if found is None:
        tags = {EXPERIMENT_KIND_TAG: CUSTOM_MODEL_DEVELOPMENT}
        location = artifact_location(name, artifact_root, root)
        found = mlflow.get_experiment(mlflow.create_experiment(name, artifact_location=location, tags=tags))
    elif EXPERIMENT_KIND_TAG not in found.tags:
        MlflowClient().set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, CUSTOM_MODEL_DEVELOPMENT)
    anchor(mlflow.get_tracking_uri())  # a sqlite store records its directory once, when a writer first uses it
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


def input_signature(detector: Any) -> Any:
    """The MLflow signature of ``detector``'s pyfunc: the input columns its class declares (``INPUTS``, a
    :class:`~detectors.registry.artifact.FrameInputs`), so MLflow and its scoring server refuse a frame without them."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    inputs = getattr(type(detector), "INPUTS", None)
    if inputs is None:
        raise TypeError(f"{type(detector).__name__} declares no INPUTS (its predict_frame columns): add one to log it")
    columns = [ColSpec(kind, name) for name, kind in inputs.required.items()]
    columns += [ColSpec(kind, name, required=False) for name, kind in inputs.optional.items()]
    return ModelSignature(inputs=Schema(columns))


def log_detector(detector: Any, artifact_dir: str | Path, metadata: dict[str, Any]) -> Any:
    """Log ``detector``'s directory as a models-from-code pyfunc (weights stay safetensors, no pickle), with its input
    signature (:func:`input_signature`) and the pip requirements its code and artifact need
    (:mod:`detectors.registry.requirements`)."""
    config = read_config(artifact_dir)
    # no input example on purpose: MLflow would run the detector, and load its LLM, to check it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*An input example was not provided", category=UserWarning)
        return mlflow.pyfunc.log_model(
            name="model",
            python_model=str(PYFUNC_MODEL),
            artifacts={"detector": str(artifact_dir)},
            code_paths=[str(Path(__file__).parents[1])],  # the detectors package
            pip_requirements=pip_requirements(type(detector).__module__, config),
            signature=input_signature(detector),
            metadata=metadata,
        )


def _number(value: str | None) -> float:
    try:
        return float(value) if value is not None else math.nan
    except ValueError:
        return math.nan


CHAMPION_SIDE, NEW_SIDE = "champion", "new"  # the two sides of the champion rule's choice


def decide(
    val_auroc: float,
    val_digest: str | None,
    llm: str,
    champion: Any | None,
    features: str | None = None,
    against: Any | None = None,
) -> tuple[str, str]:
    """``("champion" | "challenger", why)`` for a new version against the ``champion`` version.

    ``features`` (None: not compared) names what the detector reads; a champion with another or no feature set is
    another detector under the same name (e.g. ``dior-early`` before it became DioR's RNN over IG(Q) alone).
    ``against``: the rule's :class:`~detectors.evaluation.choice.Choice` between the champion's and the new version's
    validation scores of the same units (:func:`~detectors.evaluation.choice.versus`, default side ``champion``); None
    when there is nothing to pair."""
    if not math.isfinite(val_auroc):
        return CHALLENGER, f"validation AUROC is {val_auroc}: not comparable (e.g. a one-class validation split)"
    if val_digest is None:
        return CHALLENGER, "no validation set was recorded: not comparable"
    if champion is None:
        return "champion", "no champion yet"
    tags = champion.tags
    if tags.get("val_digest") != val_digest:
        return (
            CHALLENGER,
            f"validation set {val_digest} differs from champion v{champion.version}'s {tags.get('val_digest')}",
        )
    if tags.get("llm_digest") != llm:
        return CHALLENGER, f"LLM {llm} differs from champion v{champion.version}'s {tags.get('llm_digest')}"
    if features is not None and tags.get("features") != features:
        return CHALLENGER, f"feature set {features} differs from champion v{champion.version}'s {tags.get('features')}"
    current = _number(tags.get("val_auroc"))
    if not math.isfinite(current):
        return "champion", f"champion v{champion.version} has no finite validation AUROC"
    if against is None:
        return (
            CHALLENGER,
            f"no validation scores of the same units to pair with champion v{champion.version}'s (one of them was "
            "registered without them): not comparable by the rule; promote by hand",
        )
    delta, low, high = against.deltas[NEW_SIDE]
    measured = f"{delta:+.4f} [{low:+.4f}, {high:+.4f}] on {against.units} validation units"
    if against.moved:
        return (
            "champion",
            f"validation AUROC {val_auroc:.4f} beats champion v{champion.version}'s {current:.4f}: {measured}",
        )
    how = "below" if NEW_SIDE in against.worse else "level with"
    return (
        CHALLENGER,
        f"validation AUROC {val_auroc:.4f} is {how} champion v{champion.version}'s {current:.4f}: {measured} (the "
        "champion stays unless the interval is above 0)",
    )


VALIDATION_TAG = "validation_scores"  # a version's tag naming its run's artifact of validation scores


def validation_scores(client: MlflowClient, version: Any) -> dict | None:
    """The validation scores a registered version kept (:func:`register`'s ``validation``), None when it kept none."""
    path = version.tags.get(VALIDATION_TAG)
    if not path or not version.run_id:
        return None
    try:
        return mlflow.artifacts.load_dict(f"runs:/{version.run_id}/{path}")
    except (MlflowException, OSError):  # removed, or a store that never held it: not comparable
        return None


def alias_version(client: MlflowClient, name: str, alias: str) -> Any | None:
    """The version ``alias`` points to, or None when the model has no such alias; a store error is raised.

    Read from the registered model's alias map, not ``get_model_version_by_alias``: MLflow 3.17's sqlite store
    answers a missing alias with INVALID_PARAMETER_VALUE, the error code of a malformed request too."""
    version = client.get_registered_model(name).aliases.get(alias)
    return None if version is None else client.get_model_version(name, str(version))


def register(
    model_uri: str,
    name: str,
    alias: str,
    val_auroc: float,
    val_digest: str | None,
    llm: str,
    features: str | None = None,
    validation: dict | None = None,
    rule: Callable[[dict, dict, tuple[str, str]], Any] | None = None,
) -> dict[str, Any]:
    """Register a new version tagged with its validation AUROC, validation-set digest, LLM digest and feature set (when
    given), keep its ``validation`` scores (:func:`~detectors.evaluation.choice.scored_units`; an artifact of the run
    that logged the model) and apply the champion rule (:func:`decide`), ``rule(champion's kept scores, validation,
    (CHAMPION_SIDE, NEW_SIDE))`` being the choice between them (:func:`detectors.evaluation.choice.versus`; without a
    rule a version never replaces a champion): the result says where ``alias`` points and why, and records the rule's
    choice (``choice``)."""
    if alias == CHALLENGER:
        raise ValueError(f"alias {alias!r} is reserved for versions that cannot be compared; name another alias")
    client = MlflowClient()
    version = mlflow.register_model(model_uri, name)
    val_auroc = float(val_auroc)
    tags = {"val_auroc": repr(val_auroc), "val_digest": val_digest or "", "llm_digest": llm}
    tags |= {} if features is None else {"features": features}
    if validation is not None and version.run_id:
        tags[VALIDATION_TAG] = f"validation/{name}-v{version.version}.json"
        client.log_dict(version.run_id, dict(validation), tags[VALIDATION_TAG])
    current = alias_version(client, name, alias)
    kept = None if current is None or validation is None or rule is None else validation_scores(client, current)
    against = None if kept is None else rule(kept, validation, (CHAMPION_SIDE, NEW_SIDE))
    decision, reason = decide(val_auroc, val_digest, llm, current, features, against)
    tags["decision"] = decision
    if against is not None:
        delta, low, high = against.deltas[NEW_SIDE]
        tags |= {"rule.delta_auroc": f"{delta:+.4f} [{low:+.4f}, {high:+.4f}]", "rule.units": str(against.units)}
    for key, value in tags.items():
        client.set_model_version_tag(name, version.version, key, value)
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
        "choice": None if against is None else against.as_dict(),
    }


def registered_model(client: MlflowClient, name: str) -> Any:
    """The registered model ``name``; a name the store does not hold is a :class:`NotRegisteredError` listing those it
    holds."""
    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":  # a store error stays one
            raise
        known = sorted(m.name for m in client.search_registered_models(max_results=1000))
        raise NotRegisteredError(
            f"no model registered as {name!r} in {mlflow.get_tracking_uri()} (registered: "
            f"{', '.join(known) or 'none'}): "
            "check the name, or run `dvc repro` to register the detectors"
        ) from None


def resolve(name: str, alias: str | None = None, version: int | str | None = None) -> Any:
    """The version of model ``name`` that ``alias`` points to, or version ``version``; a missing model, alias or version
    is a
    :class:`NotRegisteredError` that lists what the store holds."""
    client = MlflowClient()
    model = registered_model(client, name)
    if version is None:
        if alias not in model.aliases:
            held = ", ".join(f"{a} (v{v})" for a, v in sorted(model.aliases.items())) or "none"
            raise NotRegisteredError(
                f"model {name!r} has no alias {alias!r} in {mlflow.get_tracking_uri()} (aliases: {held})"
            )
        version = model.aliases[alias]
    try:
        return client.get_model_version(name, str(version))
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":  # a store error stays one
            raise
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        raise NotRegisteredError(
            f"model {name!r} has no version {version} in {mlflow.get_tracking_uri()} (versions: {versions})"
        ) from None


def local_artifacts(name: str, version: int | str) -> Path | None:
    """The local directory that holds the artifacts of ``version`` of model ``name`` (None: they are not in a local
    directory, e.g. behind a tracking server)."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    location = MlflowClient().get_model_version_download_uri(name, str(version))
    if location.startswith("file:"):
        return Path(local_file_uri_to_path(location))
    return None if URI_SCHEME.match(location) else Path(location)  # mlflow-artifacts:, s3:, ...: not local


def load_version(version: Any, alias: str | None = None) -> Any:
    """The pyfunc of the registered ``version`` (a ModelVersion, reached through ``alias`` if given), its detector's
    files verified before anything is read from them. A local artifact directory that is gone, or a file of the
    detector that is missing, unreadable or not the one registered, is an
    :class:`~detectors.registry.artifact.ArtifactIntegrityError` naming the path, the model and version, and what to
    do."""
    name = version.name
    what = f"{name} v{version.version}" + (f" ({name}@{alias})" if alias else "")
    fix = REREGISTER.format(name=name, stage="register_ctrla" if name.startswith("ctrla-") else "register")
    local = local_artifacts(name, version.version)
    if local is not None and not local.is_dir():
        gone = next((p for p in reversed([local, *local.parents]) if not p.exists()), local)  # the first missing one
        raise ArtifactIntegrityError(
            f"the artifacts of {what} are missing: {gone} is not a directory (they were in {local}; a store copied "
            "or moved without its artifact root?)",
            f"restore it, or {fix}",
        )
    try:
        return mlflow.pyfunc.load_model(f"models:/{name}/{version.version}")
    except ArtifactIntegrityError as err:
        raise ArtifactIntegrityError(f"{what} cannot be served: {err.problem}", fix) from None


def promote(name: str, version: int | str, alias: str = "champion") -> dict[str, Any]:
    """Move ``alias`` to ``version`` of model ``name`` (a person's decision, e.g. for a challenger evaluated on
    a new validation set); drops the challenger alias when it pointed there. Later versions compare with it."""
    client = MlflowClient()
    target = resolve(name, version=version)  # a missing model or version is an error naming it
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
    validation: dict | None = None,
    rule: Callable[[dict, dict, tuple[str, str]], Any] | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One run that logs ``detector`` (a :class:`~detectors.interfaces.Detector` loaded from ``artifact_dir``)
    with its params, metrics and ``tags`` (the choices its training made, say), registers it as ``name`` and applies
    the champion rule (``features``, ``validation``, ``rule``: see :func:`register`); returns :func:`register`'s result
    with the run id and model URI."""
    llm = llm_digest(detector.fingerprint)
    with mlflow.start_run(experiment_id=experiment_id, run_name=name) as run:
        mlflow.log_params(params)
        mlflow.log_metrics(
            {k: v for k, v in {"val_auroc": val_auroc, **metrics}.items() if v is not None and math.isfinite(v)}
        )
        mlflow.set_tags({"val_digest": val_digest or "", "llm_digest": llm, **(tags or {})})
        info = log_detector(detector, artifact_dir, metadata)
        result = register(info.model_uri, name, alias, val_auroc, val_digest, llm, features, validation, rule)
        mlflow.set_tags({"decision": result["decision"], "champion_version": str(result["champion_version"])})
    return {**result, "run_id": run.info.run_id, "model_uri": info.model_uri}


# the older `python -m detectors.registry.store promote NAME VERSION`: the `dynrag` command line runs it
if __name__ == "__main__":
    import runpy

    runpy.run_module("detectors.cli", run_name="__main__", alter_sys=True)
