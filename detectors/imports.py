"""What Python loads for an import, read from the source (never by importing): the project files of an
import closure and the other modules it needs. The DAG's code deps, the build stages' code digest and a
logged detector's pip requirements are all computed from it.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the directory holding the detectors package
REGISTERED = re.compile(r"(?:detectors|pipelines)(?:\.\w+)+:\w+")  # a lazy registry's "module:attribute"


def module_file(module: str, root: Path = ROOT) -> Path | None:
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def imported_modules(path: Path, top_level_only: bool = False, registered: bool = True) -> set[str]:
    """Every module an import statement of ``path`` names (inside functions too unless ``top_level_only``), and every
    module a ``"package.module:attribute"`` string names (an entry of a lazy registry, :mod:`detectors.lazy`) unless
    ``registered`` is False: what the file loads (a closure) counts the entries, its import statements (the layering of
    the packages) do not.

    Imports inside a module-level ``__getattr__`` are lazy attribute loads (``detectors.load_detector``) that
    run only when the attribute is used, so they are not imports of the module.
    """
    tree = ast.parse(path.read_text())
    lazy = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for n in ast.walk(f)}
    nodes = tree.body if top_level_only else ast.walk(tree)
    out: set[str] = set()
    for node in nodes:
        if id(node) in lazy:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise ValueError(f"{path}: use absolute imports (the import closure is computed from module names)")
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules imported by name
        elif (
            registered
            and not top_level_only
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and REGISTERED.fullmatch(node.value)
        ):
            out.add(node.value.partition(":")[0])
    return out


def import_closure(
    modules: Iterable[str], packages: Iterable[str] = ("detectors",), root: Path = ROOT, lazy: Iterable[str] = ()
) -> tuple[set[Path], set[str]]:
    """The files of ``packages`` (relative to ``root``) that importing ``modules`` loads (each module, its
    packages' ``__init__`` files, and what they import, transitively), and every other module they import.
    The function-level imports of the ``lazy`` modules are not followed."""
    packages, lazy = tuple(packages), set(lazy)
    files: set[Path] = set()
    external: set[str] = set()
    todo, done = list(modules), set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        parts = name.split(".")
        if parts[0] not in packages:
            external.add(name)
            continue
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            path = module_file(prefix, root)
            if path is not None and path not in files:
                files.add(path)
                todo.extend(imported_modules(path, top_level_only=prefix in lazy))
    return {p.relative_to(root) for p in files}, external


def files_digest(files: Iterable[Path], root: Path = ROOT) -> str:
    """SHA-256 (shortened) of the names and bytes of project ``files`` (relative to ``root``)."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel.as_posix()}\0".encode())
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def closure_digest(
    modules: Iterable[str], lazy: Iterable[str] = (), packages: Iterable[str] = ("detectors",), root: Path = ROOT
) -> str:
    """:func:`files_digest` of the files of ``packages`` that importing ``modules`` loads, the function-level imports
    and registry entries of the ``lazy`` modules (modules that dispatch by name) not followed: the code of one
    computation, not of everything that could run beside it."""
    return files_digest(import_closure(sorted(set(modules)), packages, root, lazy)[0], root)
