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

import importlib.metadata
import sys
from collections.abc import Iterable
from typing import Any

from detectors.imports import import_closure

PYFUNC_MODULE = "detectors.registry.pyfunc"
# kinds.KINDS holds every declared kind, but only the loaded kind's class is imported
LAZY_MODULES = ("detectors.registry.kinds",)
DATA_KEYS = (("spacy_model",), ("embedding_model",), ("llm", "source"))  # detector.json entries naming a package


class RequirementError(RuntimeError):
    """A module a detector imports, or a package its artifact names, is not installed."""


def third_party(modules: Iterable[str]) -> set[str]:
    """The top-level names of ``modules`` outside the standard library."""
    tops = {m.split(".")[0] for m in modules}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "__future__"}


def distributions(top_level: Iterable[str], what: str, index: dict[str, list[str]]) -> set[str]:
    """The installed distributions providing the top-level modules ``top_level`` (``index``: top-level module →
    distributions, as ``importlib.metadata.packages_distributions()`` gives it); a missing one is an error."""
    out: set[str] = set()
    for name in sorted(top_level):
        if name not in index:
            raise RequirementError(
                f"{what} needs the module {name!r}, which no installed distribution provides; install it"
            )
        out.update(index[name])
    return out


def code_modules(kind_module: str) -> set[str]:
    """Third-party top-level modules imported by ``kind_module`` and the pyfunc entry point."""
    _, external = import_closure([kind_module, PYFUNC_MODULE], lazy=LAZY_MODULES)
    return third_party(external)


def data_modules(config: dict[str, Any], index: dict[str, list[str]]) -> set[str]:
    """Packages ``detector.json`` names as data: those of :data:`DATA_KEYS` that are installed packages (in
    ``index``), and ``gguf`` when the LLM was read from a GGUF file (transformers needs it to load one)."""
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
    index = importlib.metadata.packages_distributions()  # scans every installed distribution: once
    dists = distributions(code_modules(kind_module) | data_modules(config, index), what, index)
    return sorted(f"{d}=={importlib.metadata.version(d)}" for d in dists)
