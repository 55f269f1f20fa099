"""The ``paths`` section of ``params.yaml``: every file or directory that a stage writes and another reads (relative to
the project root), by name. The section is open (any name; :class:`Paths` validates the values, not a list of keys),
so a new path is data: it changes no stage's code deps or shard keys, and only the stages that declare it read it."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from detectors.config.core import fail

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "paths": "Paths",
}

KEY = re.compile(r"[a-z][a-z0-9_]*")


class Paths(Mapping[str, str]):
    """The paths by name, also as attributes (``paths.qa``)."""

    def __init__(self, paths: Mapping[str, str]):
        self._paths = dict(paths)

    @classmethod
    def from_params(cls, data: Any, where: str) -> Paths:
        """The section ``where`` of params.yaml: a mapping of names (lower-case identifiers) to non-empty path
        strings."""
        if not isinstance(data, dict) or not data:
            fail(where, data, "expected a mapping of path names to paths, e.g. {qa: data/prepared/qa.parquet}")
        for key, value in data.items():
            if not isinstance(key, str) or not KEY.fullmatch(key):
                fail(f"{where}.{key}", value, "a path's name is a lower-case identifier (letters, digits, '_')")
            if not isinstance(value, str) or not value.strip():
                fail(f"{where}.{key}", value, "must name a path")
        return cls(data)

    def __getattr__(self, key: str) -> str:
        try:
            return self.__dict__["_paths"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __getitem__(self, key: str) -> str:
        return self._paths[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)
