"""A stage's directory of artifacts rebuilt beside the old one and swapped in at the end."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def swapped_in(directory: str | Path) -> Iterator[Path]:
    """An empty ``<directory>.partial`` to write into; when the block ends without error it replaces ``directory``, so
    the directory holds exactly this run's artifacts and a failed run leaves the last ones."""
    out = Path(directory)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
