"""Lazy registries (in the spirit of lm-evaluation-harness's ``"module:Class"`` registry): names mapped to
``"module:attribute"`` strings, imported when a name is first asked for, so a registry costs nothing until used and
adding an entry is one line in one place. An unknown name is a clear error that lists the known ones.

A registry may instead be *declared* (:meth:`LazyRegistry.declared`): its entries are the classes that declare a
name as a class attribute (``KIND = "dior-early"``), found in the sources, so a new class registers itself where it is
written and no list names it.

The import closure (:mod:`detectors.imports`) counts every ``"detectors.…:attribute"`` string of a module, and every
class a ``LazyRegistry.declared`` call of it finds, as an import of that module, so a stage that holds a registry
depends on everything the registry can load.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from detectors.errors import InputError
from detectors.imports import declared_classes


class LazyRegistry(Mapping[str, str]):
    """``what`` (e.g. "detector kind") by name: ``entries`` maps each name to ``"module:attribute"``."""

    def __init__(self, what: str, entries: Mapping[str, str], error: type[Exception] = InputError):
        for name, target in entries.items():
            if target.count(":") != 1 or not all(target.split(":")):
                raise ValueError(f"{what} {name!r}: {target!r} is not 'module:attribute'")
        self.what, self.entries, self.error = what, dict(entries), error

    @classmethod
    def declared(cls, what: str, attribute: str, error: type[Exception] = InputError) -> LazyRegistry:
        """The registry of the ``detectors`` classes that assign a string to ``attribute``, by that string, read from
        the sources (:func:`~detectors.imports.declared_classes`; two classes declaring one name are a ValueError).
        Write ``attribute`` as a string literal: the import closure reads it."""
        return cls(what, declared_classes(attribute), error)

    def __getitem__(self, name: str) -> str:
        return self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, name: str) -> None:
        """Raise ``error`` naming ``name`` and the known names when ``name`` is not registered."""
        if name not in self.entries:
            raise self.error(f"no {self.what} named {name!r}; known: {', '.join(sorted(self.entries))}")

    def module(self, name: str) -> str:
        self.check(name)
        return self.entries[name].partition(":")[0]

    def load(self, name: str) -> Any:
        """The attribute registered under ``name``, imported now."""
        self.check(name)
        module, _, attribute = self.entries[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
