"""The params sections many stages read: ``paths`` (every file the stages share, named once; ``dvc.yaml``
reads the same keys through its templating, ``${paths.qa}``), ``llm``, ``mlflow``, ``execution`` and the
register sections' common shape, with the checks other sections share."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Literal

from detectors.config.core import check_splits, fail, positive

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "llm": "LLMParams",
    "mlflow": "MLflowParams",
    "execution": "ExecutionParams",
    "register": "RegisterParams",
}


def check_sampled_source(where: str, source: str, limit: int | None, splits: dict[str, float], sources: str) -> None:
    """A data source sampled to ``limit`` records (by id hash) and split by id hash."""
    if not source.strip():
        fail(f"{where}.source", source, sources)
    if limit is not None:
        positive(f"{where}.limit", limit)
    check_splits(f"{where}.splits", splits)


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a directory name and an MLflow registered-model name


def check_model_name(key: str, name: str) -> None:
    if not MODEL_NAME.fullmatch(name):
        fail(key, name, "use letters, digits, '.', '_' and '-' only, starting with a letter or digit")


@dataclasses.dataclass(frozen=True)
class LLMParams:
    """Which LLM to use (prepare writes its local checkpoint, or a pointer to it, at ``paths.llm``)."""

    source: str
    gguf_file: str | None
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    device: str

    def check(self, where: str) -> None:
        if not self.source.strip():
            fail(
                f"{where}.source",
                self.source,
                "name a pip package with a GGUF, a .gguf file, a checkpoint dir or a hub id",
            )
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            fail(f"{where}.device", self.device, "use auto, cpu or cuda[:N]")


STORE_URIS = ("sqlite:///", "http://", "https://", "postgresql", "mysql")  # the stores the project reads and writes
URI_SCHEME = re.compile(r"([A-Za-z][\w+.-]*):")  # what a URI starts with, and a plain path does not


def store_uri_problem(uri: str, root: str | Path = ".") -> str | None:
    """What is wrong with tracking URI ``uri`` as a store of the project, and what to give instead (None: nothing). A
    plain path or a ``file:`` URI is MLflow's deprecated file store: refused with the ``sqlite:///`` form of the same
    place (relative to ``root``)."""
    if uri.startswith(STORE_URIS):
        return None
    scheme = URI_SCHEME.match(uri)
    server = "a tracking server as http://host:port"
    if scheme is not None and scheme.group(1).lower() != "file":
        return f"not a store the project uses: name a sqlite, postgresql or mysql database, or {server}"
    path = (Path(root) / re.sub(r"^file:(//)?", "", uri)).resolve()
    db = path if path.suffix == ".db" else path / "mlflow.db"
    kind = "a file: URI" if scheme else "a plain path"
    return (
        f"{kind}, which MLflow reads as its deprecated file store: name a sqlite store as sqlite:///{db} (the "
        f"project's is sqlite:///data/mlflow/mlflow.db, relative to the project root), or {server}"
    )


@dataclasses.dataclass(frozen=True)
class MLflowParams:
    """The tracking store and registry: a sqlite file of the project, a team's database, or a shared ``mlflow
    server``."""

    tracking_uri: str
    # where new experiments keep their artifacts: a directory, or an object-store URI (s3://...)
    artifact_root: str | None

    def check(self, where: str) -> None:
        problem = store_uri_problem(self.tracking_uri)
        if problem is not None:
            fail(f"{where}.tracking_uri", self.tracking_uri, problem)
        server = self.tracking_uri.startswith(("http://", "https://"))
        if self.artifact_root is None and not server:
            fail(
                f"{where}.artifact_root",
                None,
                (
                    "only a tracking server (http://host:port) chooses the artifact root itself: give a directory or "
                    "an s3://... URI"
                ),
            )
        if server and self.artifact_root is not None and "://" not in self.artifact_root:
            fail(
                f"{where}.artifact_root",
                self.artifact_root,
                "with a tracking server, a local directory would keep each client's artifacts on its own "
                "machine: use null (the server's --artifacts-destination) or a URI every client reaches (s3://bucket/path)",
            )


@dataclasses.dataclass(frozen=True)
class RegisteredDetector:
    """A trained detector the register stage registers: its artifact (a directory with ``detector.json``) and its
    test metrics, the object at ``keys`` in the JSON file ``metrics`` (a dict with an ``auroc``)."""

    artifact: str
    metrics: str
    keys: list[str]

    def check(self, where: str) -> None:
        if not self.keys:
            fail(f"{where}.keys", self.keys, "give the keys down to the detector's test metrics in the metrics file")


@dataclasses.dataclass(frozen=True)
class RegisterParams:
    """The trained detectors to register (one ``register`` stage each: ``dvc.yaml``'s ``foreach``), by the name they
    are registered under, with the champion alias and the MLflow experiment of their runs."""

    alias: str
    experiment: str
    detectors: dict[str, RegisteredDetector]

    def check(self, where: str) -> None:
        if not self.detectors:
            fail(f"{where}.detectors", self.detectors, "name at least one trained detector to register")
        for name in self.detectors:
            check_model_name(f"{where}.detectors", name)


@dataclasses.dataclass(frozen=True)
class ExecutionParams:
    """Where the stages that load the LLM (build_early, build_realtime, extract_directions, rag_eval) run their units
    of work (shards, concepts, run files): one after another in the stage's process, or on an actor pool of a Ray
    cluster (:mod:`detectors.execution`). The outputs are the same either way; only the speed differs."""

    backend: Literal["local", "ray"]
    # ray: None = start Ray on this machine; "auto" = the cluster `ray start` runs here; ray://host:port
    address: str | None
    workers: int  # ray: actors, each loading the LLM once (one per GPU, or per CPU worker)
    gpus_per_worker: float  # ray: GPUs per actor (0 = CPU workers)
    cpus_per_worker: float  # ray: CPU cores per actor (its torch threads)

    def check(self, where: str) -> None:
        positive(f"{where}.workers", self.workers)
        positive(f"{where}.cpus_per_worker", self.cpus_per_worker)
        if not self.gpus_per_worker >= 0:
            fail(
                f"{where}.gpus_per_worker",
                self.gpus_per_worker,
                "must be >= 0 (0 = CPU workers, 1 = one actor per GPU)",
            )
        if self.address is not None and not (
            self.address == "auto" or self.address.startswith("ray://") or ":" in self.address
        ):
            fail(
                f"{where}.address",
                self.address,
                "use null (start Ray here), auto (the running cluster), host:port or ray://host:port",
            )
