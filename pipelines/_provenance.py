"""What a stage's records depend on beyond their input rows: the project code the stage imports (its
import closure, which is also its code deps in ``dvc.yaml``), the libraries that compute the numbers,
and the LLM as loaded. Build stages key their resumable shards on it, so that resuming is only ever
resuming the same computation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
from pathlib import Path
from typing import Any, Iterable

from detectors.execution import LLMSpec
from detectors.imports import ROOT, import_closure
from detectors.io import file_digest
from detectors.shards import FailureBudget, ShardStore

log = logging.getLogger(__name__)

PACKAGES = ("detectors", "pipelines")


def stage_closure(module: str, root: Path = ROOT) -> set[Path]:
    """The project files (relative to ``root``) that ``python -m <module>`` loads: its code deps."""
    return import_closure([module], PACKAGES, root)[0]


def code_digest(module: str, root: Path = ROOT) -> str:
    """SHA-256 (shortened) of the names and bytes of every file in ``module``'s import closure."""
    digest = hashlib.sha256()
    for rel in sorted(stage_closure(module, root)):
        digest.update(f"{rel.as_posix()}\0".encode())
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of the distributions that compute a stage's numbers."""
    return {name: importlib.metadata.version(name) for name in names}


def record_key(module: str, params: dict[str, Any], llm: LLMSpec, inputs: dict[str, str], libraries: Iterable[str]) -> dict[str, Any]:
    """Everything that shapes the records of stage ``module``: the params that enter a record, the LLM
    (fingerprint, dtype, device type), the input tables' digests, the code and the library versions."""
    return {
        "params": params,
        "llm": llm.key(),
        "inputs": {name: file_digest(path) for name, path in inputs.items()},
        "code": code_digest(module),
        "libraries": library_versions(libraries),
    }


def open_shards(stage: str, params: Any, llm: LLMSpec, inputs: dict[str, str], libraries: Iterable[str], directory: str, n_records: int,
                shared: dict[str, Any] | None = None):  # fmt: skip
    """The shard store of build stage ``stage`` (section ``params``), keyed on what shapes its records
    (every key of the section but ``max_failed_share``, and the ``shared`` params it reads from other sections), and
    the failure budget of its ``n_records``."""
    shaping = {k: v for k, v in dataclasses.asdict(params).items() if k != "max_failed_share"} | (shared or {})
    store = ShardStore(directory, record_key(f"pipelines.{stage}", shaping, llm, inputs, libraries))
    key = llm.key()
    log.info("%s: LLM %s (%s on %s)", stage, key["name"], key["dtype"], key["device"])
    return store, FailureBudget(n_records, params.max_failed_share, f"{stage}.max_failed_share", store.dir)
