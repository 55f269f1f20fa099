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


def declared_classes(
    attribute: str, having: str | None = None, package: str = "detectors", root: Path = ROOT
) -> dict[str, str]:
    """``{value: "module:Class"}`` for every class of ``package`` whose body assigns a string to ``attribute`` (and
    one to ``having`` too, when given), read from the sources, never by importing them: the entries of a declared
    registry (:meth:`detectors.lazy.LazyRegistry.declared`). Two classes declaring one value is a ValueError naming
    both."""
    found: dict[str, str] = {}
    assigns = re.compile(rf"^[ \t]+{attribute}\s*=", re.M)  # only the files that could declare it are parsed
    for path in sorted((root / package).rglob("*.py")):
        text = path.read_text()
        if not assigns.search(text):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(text).body:
            if not isinstance(node, ast.ClassDef):
                continue
            values = {
                t.id: s.value.value
                for s in node.body
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)
                for t in s.targets
                if isinstance(t, ast.Name)
            }
            if attribute not in values or (having is not None and having not in values):
                continue
            value, target = values[attribute], f"{module}:{node.name}"
            if value in found:
                raise ValueError(f"{attribute} = {value!r} is declared twice ({found[value]} and {target}): keep one")
            found[value] = target
    return found


def _declared_attribute(node: ast.AST, path: Path) -> str | None:
    """The ``attribute`` of a ``LazyRegistry.declared(what, attribute, ...)`` call; None for any other node (a
    ValueError when it is not written as a string: the closure could not read it)."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "declared"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "LazyRegistry"
    ):
        return None
    given = dict(zip(("what", "attribute"), node.args)) | {k.arg: k.value for k in node.keywords}
    attribute = given.get("attribute")
    if not (isinstance(attribute, ast.Constant) and isinstance(attribute.value, str)):
        raise ValueError(f"{path}:{node.lineno}: write LazyRegistry.declared's attribute as a string literal")
    return attribute.value


def imported_modules(path: Path, top_level_only: bool = False, registered: bool = True, root: Path = ROOT) -> set[str]:
    """Every module an import statement of ``path`` names (inside functions too unless ``top_level_only``), and every
    module a ``"package.module:attribute"`` string names (an entry of a lazy registry, :mod:`detectors.lazy`) or a
    ``LazyRegistry.declared(...)`` call finds declared (:func:`declared_classes` under ``root``) unless
    ``registered`` is False: what the file loads (a closure) counts the entries, its import statements (the layering
    of the packages) do not.

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
        elif registered and not top_level_only and (attribute := _declared_attribute(node, path)):
            out.update(t.partition(":")[0] for t in declared_classes(attribute, root=root).values())
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
                todo.extend(imported_modules(path, top_level_only=prefix in lazy, root=root))
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
