"""Small file helpers shared by the stages and the library: atomic JSON, and the sha256 digests that identify a file
(in shard keys and MLflow tags) and verify one (a BM25 index, a detector artifact, a shard: :func:`file_digests` when
written, :func:`changed_file` when read)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (a crash never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def file_digest(path: str | Path, length: int | None = 16) -> str:
    """SHA-256 of a file's bytes (read in blocks), shortened to ``length`` hex digits (None: all 64): identifies an
    input table in shard keys and MLflow tags."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:length]


def cpu_threads(limit: int | None = None) -> int:
    """The CPUs this process may run on (its affinity), at most ``limit``, at least 1."""
    cpus = len(os.sched_getaffinity(0))
    return max(1, cpus if limit is None else min(limit, cpus))


def file_digests(directory: str | Path, names: Iterable[str]) -> dict[str, str]:
    """The full SHA-256 of each file ``names`` (paths relative to ``directory``), to record when they are written;
    several files are read at once (hashlib releases the GIL), so a large index is hashed at the disk's speed."""
    names = list(names)
    with ThreadPoolExecutor(cpu_threads(len(names))) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(Path(directory) / name, None), names)))


def _problem(path: Path, digest: str) -> str | None:
    try:
        actual = file_digest(path, None)
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    if actual != digest:
        return (
            f"{path} is not the file that was written: its sha256 is {actual[:12]}…, the recorded one "
            f"{str(digest)[:12]}… (corrupted, truncated or replaced)"
        )
    return None


def changed_file(directory: str | Path, recorded: Mapping[str, str]) -> str | None:
    """What is wrong with the first file of ``recorded`` (:func:`file_digests`) that is missing, unreadable or not what
    was written, naming its path (None: every file matches); the files are read several at once."""
    items = list(recorded.items())
    with ThreadPoolExecutor(cpu_threads(len(items))) as pool:
        problems = pool.map(lambda item: _problem(Path(directory) / item[0], item[1]), items)
        return next((p for p in problems if p is not None), None)
