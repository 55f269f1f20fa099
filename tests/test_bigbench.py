"""The bigbench source archive: its pinned sha256 is checked before anything is unpacked from it."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from detectors.errors import SourceError
from detectors.sources import bigbench

EXAMPLES = [{"input": "The capital of France is", "target": "Paris"}]


def write_archive(raw_dir: Path) -> Path:
    """A real small tar.gz laid out like the bigbench sdist, under the name the pinned one has."""
    path = raw_dir / "bigbench" / bigbench.ARCHIVE
    path.parent.mkdir(parents=True)
    data = json.dumps({"examples": EXAMPLES}).encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"bigbench-{bigbench.BIGBENCH_VERSION}/bigbench/benchmark_tasks/tiny/task.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_a_tampered_archive_is_refused_and_nothing_is_unpacked(tmp_path):
    archive = write_archive(tmp_path)
    actual = hashlib.sha256(archive.read_bytes()).hexdigest()
    message = f"{archive}: sha256 is {actual}, expected {bigbench.BIGBENCH_SHA256}"
    with pytest.raises(SourceError, match=re.escape(message) + ".*Delete the file and rerun"):
        bigbench.fetch_bigbench_task("tiny", tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "bigbench",
        f"bigbench/{bigbench.ARCHIVE}",
    ]


def test_an_archive_with_the_pinned_hash_is_unpacked(tmp_path, monkeypatch):
    archive = write_archive(tmp_path)
    monkeypatch.setattr(bigbench, "BIGBENCH_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    assert bigbench.fetch_bigbench_task("tiny", tmp_path) == EXAMPLES
    assert json.loads((tmp_path / "bigbench" / "tiny" / "task.json").read_text())["examples"] == EXAMPLES
