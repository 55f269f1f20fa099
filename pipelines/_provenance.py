"""What a stage's records depend on beyond their input rows: the project code the stage imports (its
import closure, which is also its code deps in ``dvc.yaml``), the libraries that compute the numbers,
and the LLM as loaded. Build stages key their resumable shards on it, so that resuming is only ever
resuming the same computation.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import logging
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from detectors.config.sections import section_modules
from detectors.execution import LLMSpec
from detectors.imports import ROOT, import_closure, module_file
from detectors.io import file_digest
from detectors.shards import FailureBudget, ShardStore

log = logging.getLogger(__name__)

PACKAGES = ("detectors", "pipelines")


def declared_reads(module: str, root: Path = ROOT) -> tuple[str, ...]:
    """A stage module's ``READS`` (the params keys it declares), read from its source; () if it has none."""
    path = module_file(module, root)
    for node in ast.parse(path.read_text()).body if path else []:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "READS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return ()


def stage_closure(module: str, root: Path = ROOT) -> set[Path]:
    """The project files (relative to ``root``) that ``python -m <module>`` loads: its import closure and the
    modules of the params sections it reads (loaded by name when it reads them). These are its code deps."""
    return import_closure([module, *sorted(section_modules(declared_reads(module, root)))], PACKAGES, root)[0]


def stage_code_deps(module: str, root: Path = ROOT) -> list[str]:
    """``module``'s code deps as ``dvc.yaml`` lists them: its closure's files, a folder where the closure holds
    every ``.py`` file of it (a sub-package the stage imports whole), ``pipelines`` before ``detectors``."""
    files = stage_closure(module, root)
    whole = {
        d
        for d in {f.parent for f in files}
        if d.as_posix() not in PACKAGES
        and len(py := list((root / d).glob("*.py"))) > 1
        and all(p.relative_to(root) in files for p in py)
    }
    deps = {f.parent.as_posix() if f.parent in whole else f.as_posix() for f in files}
    return sorted(deps, key=lambda d: (not d.startswith("pipelines/"), d))


def write_code_deps(dvc_yaml: Path = ROOT / "dvc.yaml", root: Path = ROOT) -> str:
    """The text of ``dvc_yaml`` with every stage's code deps (its first deps) replaced by
    :func:`stage_code_deps`; the other deps (data) are kept after them, in their order."""
    text = dvc_yaml.read_text()
    stage = re.compile(r"\n  ([\w-]+):\n    cmd: python -m (\S+)\n    deps:\n((?:      - [^\n]*\n)+)")
    out, last = [], 0
    for match in stage.finditer(text):
        listed = [line.removeprefix("      - ") for line in match.group(3).splitlines()]
        data = [d for d in listed if d.split("/")[0] not in PACKAGES]
        out += [
            text[last : match.start(3)],
            "".join(f"      - {d}\n" for d in stage_code_deps(match.group(2), root) + data),
        ]
        last = match.end(3)
    return "".join(out) + text[last:]


def code_digest(module: str, root: Path = ROOT) -> str:
    """SHA-256 (shortened) of the names and bytes of every file in ``module``'s import closure."""
    digest = hashlib.sha256()
    for rel in sorted(stage_closure(module, root)):
        digest.update(f"{rel.as_posix()}\0".encode())
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def closure_digest(modules: Iterable[str], lazy: Iterable[str] = (), root: Path = ROOT) -> str:
    """SHA-256 (shortened) of the names and bytes of the project files that importing ``modules`` loads, the
    function-level imports and registry entries of the ``lazy`` modules (modules that dispatch by name) not followed:
    the code of one computation, not of everything its stage can run."""
    digest = hashlib.sha256()
    for rel in sorted(import_closure(sorted(set(modules)), PACKAGES, root, lazy)[0]):
        digest.update(f"{rel.as_posix()}\0".encode())
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of the distributions that compute a stage's numbers."""
    return {name: importlib.metadata.version(name) for name in names}


def record_key(
    module: str, params: dict[str, Any], llm: LLMSpec, inputs: dict[str, str], libraries: Iterable[str]
) -> dict[str, Any]:
    """Everything that shapes the records of stage ``module``: the params that enter a record, the LLM
    (fingerprint, dtype, device type), the input tables' digests, the code and the library versions."""
    return {
        "params": params,
        "llm": llm.key(),
        "inputs": {name: file_digest(path) for name, path in inputs.items()},
        "code": code_digest(module),
        "libraries": library_versions(libraries),
    }


def open_shards(
    stage: str,
    params: Any,
    llm: LLMSpec,
    inputs: dict[str, str],
    libraries: Iterable[str],
    directory: str,
    n_records: int,
    shared: dict[str, Any] | None = None,
    unshaping: Iterable[str] = (),
):
    """The shard store of build stage ``stage`` (section ``params``), keyed on what shapes its records
    (every key of the section but ``max_failed_share`` and the ``unshaping`` ones, and the ``shared`` params it reads
    from other sections), and the failure budget of its ``n_records``."""
    skip = {"max_failed_share", *unshaping}
    shaping = {k: v for k, v in dataclasses.asdict(params).items() if k not in skip} | (shared or {})
    store = ShardStore(directory, record_key(f"pipelines.{stage}", shaping, llm, inputs, libraries))
    key = llm.key()
    log.info("%s: LLM %s (%s on %s)", stage, key["name"], key["dtype"], key["device"])
    return store, FailureBudget(n_records, params.max_failed_share, f"{stage}.max_failed_share", store.dir)


if __name__ == "__main__":  # python -m pipelines._provenance: write every stage's code deps into dvc.yaml
    new = write_code_deps()
    changed = new != (ROOT / "dvc.yaml").read_text()
    (ROOT / "dvc.yaml").write_text(new)
    print("dvc.yaml: code deps " + ("rewritten" if changed else "already current"), file=sys.stderr)
