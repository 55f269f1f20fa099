"""Tasks of the ``bigbench==1.0.0`` source archive (PyPI), fetched once with ``pip download --no-deps``."""

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

log = logging.getLogger(__name__)

BIGBENCH_VERSION = "1.0.0"


def fetch_bigbench_task(task: str, raw_dir: str | Path, file: str = "task.json") -> list[dict[str, Any]]:
    """The examples of a bigbench task, from the source archive on PyPI (downloaded once into
    ``raw_dir``, so later tasks read the same archive; each task file is unpacked on first use).

    ``file`` names the task's JSON when it is not ``task.json`` (``truthful_qa`` has ``task_mc.json``).
    """
    raw = Path(raw_dir) / "bigbench"
    task_file = raw / task / file
    if not task_file.exists():
        task_file.parent.mkdir(parents=True, exist_ok=True)
        archive = next(raw.glob(f"bigbench-{BIGBENCH_VERSION}.tar.gz"), None)
        if archive is None:
            log.info("downloading the bigbench==%s source archive (once)", BIGBENCH_VERSION)
            with tempfile.TemporaryDirectory(dir=raw) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp, f"bigbench=={BIGBENCH_VERSION}"]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SourceError(f"could not download bigbench=={BIGBENCH_VERSION}: {done.stderr.strip()[-500:]}")
                archive = raw / f"bigbench-{BIGBENCH_VERSION}.tar.gz"
                next(Path(tmp).glob("bigbench-*.tar.gz")).replace(archive)
        member = f"bigbench-{BIGBENCH_VERSION}/bigbench/benchmark_tasks/{task}/{file}"
        with tarfile.open(archive) as tar:
            try:
                fobj = tar.extractfile(member)
            except KeyError:
                raise SourceError(f"bigbench:{task}: no file {file!r} for that task in bigbench {BIGBENCH_VERSION}") from None
            tmp_file = task_file.with_suffix(".part")
            tmp_file.write_bytes(fobj.read())
            tmp_file.replace(task_file)
    return json.loads(task_file.read_text())["examples"]
