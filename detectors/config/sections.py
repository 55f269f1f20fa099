"""Which type validates each section of ``params.yaml``: the lazy registry :data:`SECTIONS`, read from
``sections.yaml`` (``section: "module:Class"``), each type imported only when its section is read.

The registry is data so that a stage's import closure (its code deps in ``dvc.yaml`` and the key of its resumable
shards) holds the modules of the sections it reads and no other: a new section or a new ``rag_eval`` key does not
rerun ``build_early``. :func:`section_modules` tells :mod:`pipelines._provenance` which modules those are.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

from detectors.config.core import ParamsError
from detectors.lazy import LazyRegistry

SECTIONS = LazyRegistry(
    "params section", yaml.safe_load((Path(__file__).with_name("sections.yaml")).read_text()), ParamsError
)


def section_type(name: str) -> type:
    """The dataclass that validates section ``name`` (a :class:`ParamsError` listing the known sections if none)."""
    return SECTIONS.load(name)


def section_modules(reads: Iterable[str]) -> set[str]:
    """The modules whose types validate the sections that the declared keys ``reads`` (``section`` or
    ``section.key``) belong to."""
    return {SECTIONS.module(key.split(".", 1)[0]) for key in reads}
