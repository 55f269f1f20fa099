"""Which type validates each section of ``params.yaml``: the lazy registry :data:`SECTIONS`, gathered from the
``SECTION_TYPES`` literal (``{section: "Class"}``) each module of :mod:`detectors.config` declares beside its types,
read from the source without importing it; each type is imported only when its section is read.

Read as data so that a stage's import closure (its code deps in ``dvc.yaml`` and the key of its resumable shards)
holds the modules of the sections it reads and no other: a new section or a new ``rag_eval`` key does not rerun
``build_early``. :func:`section_modules` tells :mod:`pipelines._provenance` which modules those are.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from detectors.config.core import ParamsError
from detectors.lazy import LazyRegistry


def declared_sections(folder: Path = Path(__file__).parent, package: str = __package__) -> dict[str, str]:
    """``{section: "module:Class"}`` from the ``SECTION_TYPES`` of every module in ``folder`` (the modules of
    ``package``); a section two modules declare is a ParamsError naming both."""
    found: dict[str, str] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SECTION_TYPES" for t in node.targets):
                for section, cls in ast.literal_eval(node.value).items():
                    if section in found:
                        raise ParamsError(
                            f"params section {section!r} is declared twice ({found[section]} and "
                            f"{package}.{path.stem}:{cls}): keep one SECTION_TYPES entry"
                        )
                    found[section] = f"{package}.{path.stem}:{cls}"
    return found


SECTIONS = LazyRegistry("params section", declared_sections(), ParamsError)


def section_type(name: str) -> type:
    """The dataclass that validates section ``name`` (a :class:`ParamsError` listing the known sections if none)."""
    return SECTIONS.load(name)


def section_modules(reads: Iterable[str]) -> set[str]:
    """The modules whose types validate the sections that the declared keys ``reads`` (``section`` or
    ``section.key``) belong to."""
    return {SECTIONS.module(key.split(".", 1)[0]) for key in reads}
