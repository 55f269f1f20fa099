"""Tasks of the ``bigbench==1.0.0`` source archive (PyPI), fetched once with ``pip download --no-deps``.

The archive's sha256 is pinned: a downloaded archive, or one already in ``raw_dir``, is checked before
anything is unpacked from it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from detectors.errors import SourceError
from detectors.io import file_digest

log = logging.getLogger(__name__)

BIGBENCH_VERSION = "1.0.0"
ARCHIVE = f"bigbench-{BIGBENCH_VERSION}.tar.gz"
# sha256 of the PyPI sdist (pip download --no-deps --no-binary :all: bigbench==1.0.0), 358,249,635 bytes
BIGBENCH_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"


def verify_archive(path: Path) -> None:
    """Refuse an archive whose sha256 is not the pinned one (a truncated download, another release, tampering)."""
    actual = file_digest(path, None)
    if actual != BIGBENCH_SHA256:
        raise SourceError(
            f"bigbench archive {path}: sha256 is {actual}, expected {BIGBENCH_SHA256} (bigbench=={BIGBENCH_VERSION} "
            "on PyPI); nothing was unpacked from it. Delete the file and rerun to download it again."
        )


def _download_archive(raw: Path) -> Path:
    log.info("downloading the bigbench==%s source archive (once)", BIGBENCH_VERSION)
    raw.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=raw) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-q",
            "-d",
            tmp,
            f"bigbench=={BIGBENCH_VERSION}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SourceError(f"could not download bigbench=={BIGBENCH_VERSION}: {done.stderr.strip()[-500:]}")
        downloaded = Path(tmp) / ARCHIVE
        if not downloaded.exists():
            got = sorted(p.name for p in Path(tmp).iterdir())
            raise SourceError(f"pip download bigbench=={BIGBENCH_VERSION} wrote no {ARCHIVE} (got {got})")
        verify_archive(downloaded)  # before it takes the archive's place in raw_dir
        archive = raw / ARCHIVE
        downloaded.replace(archive)
    return archive


def fetch_bigbench_task(task: str, raw_dir: str | Path, file: str = "task.json") -> list[dict[str, Any]]:
    """The examples of a bigbench task, from the source archive on PyPI (downloaded once into
    ``raw_dir``, so later tasks read the same archive; each task file is unpacked on first use, after
    the archive's sha256 is checked).

    ``file`` names the task's JSON when it is not ``task.json`` (``truthful_qa`` has ``task_mc.json``).
    """
    raw = Path(raw_dir) / "bigbench"
    task_file = raw / task / file
    if not task_file.exists():
        archive = raw / ARCHIVE
        if archive.exists():
            verify_archive(archive)
        else:
            archive = _download_archive(raw)
        member = f"bigbench-{BIGBENCH_VERSION}/bigbench/benchmark_tasks/{task}/{file}"
        with tarfile.open(archive) as tar:
            try:
                fobj = tar.extractfile(member)
            except KeyError:
                raise SourceError(
                    f"bigbench:{task}: no file {file!r} for that task in bigbench {BIGBENCH_VERSION}"
                ) from None
            task_file.parent.mkdir(parents=True, exist_ok=True)
            tmp_file = task_file.with_suffix(".part")
            tmp_file.write_bytes(fobj.read())
            tmp_file.replace(task_file)
    return json.loads(task_file.read_text())["examples"]
