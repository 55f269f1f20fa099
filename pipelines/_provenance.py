"""What a stage's records depend on beyond their input rows: the project code the stage imports (its
import closure, which is also its code deps in ``dvc.yaml``), the libraries that compute the numbers,
and the LLM as loaded. Build stages key their resumable shards on it, so that resuming is only ever
resuming the same computation.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Any, Iterable

from detectors.io import file_digest
from detectors.llm.loading import LLM

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("detectors", "pipelines")


def module_file(module: str, root: Path = ROOT) -> Path | None:
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names, wherever the statement is (functions included).

    Imports inside a module-level ``__getattr__`` are lazy attribute loads (``detectors.load_detector``)
    that run only when the attribute is used, so they are not imports of the module.
    """
    tree = ast.parse(path.read_text())
    lazy = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for n in ast.walk(f)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise ValueError(f"{path}: use absolute imports (the import closure is computed from module names)")
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules imported by name
    return out


def import_closure(module: str, root: Path = ROOT) -> set[Path]:
    """The project files (relative to ``root``) Python loads for ``import module``: the module, its
    packages' ``__init__`` files, and the same for everything they import, transitively."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        parts = todo.pop().split(".")
        if parts[0] not in PACKAGES:
            continue
        for i in range(1, len(parts) + 1):
            path = module_file(".".join(parts[:i]), root)
            if path is not None and path not in seen:
                seen.add(path)
                todo.extend(imported_modules(path))
    return {p.relative_to(root) for p in seen}


def code_digest(module: str, root: Path = ROOT) -> str:
    """SHA-256 (shortened) of the names and bytes of every file in ``module``'s import closure."""
    digest = hashlib.sha256()
    for rel in sorted(import_closure(module, root)):
        digest.update(f"{rel.as_posix()}\0".encode())
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of the distributions that compute a stage's numbers."""
    return {name: importlib.metadata.version(name) for name in names}


def record_key(module: str, params: dict[str, Any], llm: LLM, inputs: dict[str, str], libraries: Iterable[str]) -> dict[str, Any]:
    """Everything that shapes the records of stage ``module``: the params that enter a record, the LLM
    (fingerprint, dtype, device type), the input tables' digests, the code and the library versions."""
    return {
        "params": params,
        "llm": {**llm.fingerprint.to_dict(), "dtype": llm.dtype_name, "device": llm.device.type},
        "inputs": {name: file_digest(path) for name, path in inputs.items()},
        "code": code_digest(module),
        "libraries": library_versions(libraries),
    }
