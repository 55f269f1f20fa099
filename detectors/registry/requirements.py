"""The pip requirements of a logged detector, derived from what its code imports and what its artifact names.

- code: the import closure of the kind's module and of the pyfunc entry point inside the ``detectors``
  package (imports inside functions included, since serving calls them), reduced to its third-party
  top-level modules, mapped to their distributions with ``importlib.metadata.packages_distributions()``;
- data: the packages the artifact's ``detector.json`` names as data (the spaCy model, the sentence-transformers
  model, the LLM source when it is an installed package, ``gguf`` when the LLM is a GGUF file).

Every requirement is pinned to the version installed now. The ``detectors`` package itself travels as the
model's ``code_paths``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path
from typing import Any, Iterable

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the detectors package
PACKAGE = "detectors"
PYFUNC_MODULE = "detectors.registry.pyfunc"
# kinds.detector_class imports every kind inside a function, but only the loaded kind's branch runs
LAZY_MODULES = ("detectors.registry.kinds",)
DATA_KEYS = (("spacy_model",), ("embedding_model",), ("llm", "source"))  # detector.json entries naming a package


class RequirementError(RuntimeError):
    """A module a detector imports, or a package its artifact names, is not installed."""


def module_file(module: str, root: Path = PACKAGE_ROOT) -> Path | None:
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def imported_modules(path: Path, top_level_only: bool = False) -> set[str]:
    """Every module an import statement of ``path`` names (inside functions too unless ``top_level_only``).

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
                raise ValueError(f"{path}: use absolute imports (the closure is computed from module names)")
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules imported by name
    return out


def import_closure(
    modules: Iterable[str], packages: Iterable[str] = (PACKAGE,), root: Path = PACKAGE_ROOT, lazy: Iterable[str] = ()
) -> tuple[set[Path], set[str]]:
    """The files of ``packages`` that ``import`` of ``modules`` loads (each module, its packages' ``__init__``
    files, and what they import, transitively), and every other module they import. The function-level
    imports of the ``lazy`` modules are not followed."""
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
    return files, external


def third_party(modules: Iterable[str]) -> set[str]:
    """The top-level names of ``modules`` outside the standard library."""
    tops = {m.split(".")[0] for m in modules}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "__future__"}


def distributions(top_level: Iterable[str], what: str) -> set[str]:
    """The installed distributions providing the top-level modules ``top_level``; a missing one is an error."""
    index = importlib.metadata.packages_distributions()
    out: set[str] = set()
    for name in sorted(top_level):
        if name not in index:
            raise RequirementError(f"{what} needs the module {name!r}, which no installed distribution provides; install it")
        out.update(index[name])
    return out


def code_modules(kind_module: str) -> set[str]:
    """Third-party top-level modules imported by ``kind_module`` and the pyfunc entry point."""
    _, external = import_closure([kind_module, PYFUNC_MODULE], lazy=LAZY_MODULES)
    return third_party(external)


def data_modules(config: dict[str, Any]) -> set[str]:
    """Packages ``detector.json`` names as data: those of :data:`DATA_KEYS` that are installed packages,
    and ``gguf`` when the LLM was read from a GGUF file (transformers needs it to load one)."""
    index = importlib.metadata.packages_distributions()
    out = set()
    for keys in DATA_KEYS:
        value: Any = config
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, str) and value.isidentifier() and value in index:
            out.add(value)
    if (config.get("llm") or {}).get("gguf_file"):
        out.add("gguf")
    return out


def pip_requirements(kind_module: str, config: dict[str, Any]) -> list[str]:
    """Pinned requirements of a detector whose class lives in ``kind_module`` and whose artifact is ``config``."""
    what = f"detector {config.get('kind')!r}"
    dists = distributions(code_modules(kind_module) | data_modules(config), what)
    return sorted(f"{d}=={importlib.metadata.version(d)}" for d in dists)
