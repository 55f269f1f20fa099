"""Local MLflow processes: ``mlflow server`` on a store (what the UI shows), any MLflow process that answers over HTTP
once ready (``mlflow models serve``), and the screenshot of the comparison view as a user sees it in headless Chromium
(``dynrag screenshot``; needs Debian's ``chromium``: ``apt-get install -y chromium``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from detectors.errors import InputError

MLFLOW = Path(sys.executable).with_name("mlflow")  # the CLI of this interpreter's environment


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether GET ``url`` answers 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running(
    cmd: list[str],
    ready_url: str,
    log: str | Path,
    *,
    cwd: str | Path | None = None,
    env: dict | None = None,
    timeout: float = 120,
) -> Iterator[subprocess.Popen]:
    """``cmd`` in its own process group, output to ``log``; yields the process once ``ready_url`` answers 200, and
    stops the whole group (the server and its workers) on exit. A process that exits or is not ready within ``timeout``
    seconds is a RuntimeError with the end of its log."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not answers(ready_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                state = (
                    f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready after {timeout:.0f} s"
                )
                raise RuntimeError(
                    f"{Path(cmd[0]).name} {cmd[1]} {state}:\n{Path(log).read_text(errors='replace')[-3000:]}"
                )
            time.sleep(0.5)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def mlflow_server(
    backend: str,
    log: str | Path,
    *,
    cwd: str | Path | None = None,
    artifacts: str | Path | None = None,
    timeout: float = 120,
) -> Iterator[str]:
    """``mlflow server`` on the store ``backend`` at a free loopback port (one worker), serving the artifacts of new
    experiments from ``artifacts`` when given; yields its base URL once ``/health`` answers."""
    port = free_port()
    cmd = [
        str(MLFLOW),
        "server",
        "--backend-store-uri",
        backend,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    cmd += ["--artifacts-destination", str(artifacts)] if artifacts else []
    base = f"http://127.0.0.1:{port}"
    with running(cmd, f"{base}/health", log, cwd=cwd, timeout=timeout):
        yield base


def find_chromium(chromium: str | None = None) -> str:
    """The Chromium executable: ``chromium`` when given (a path or a name on PATH), else Debian's on PATH."""
    found = shutil.which(chromium) if chromium else shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        where = f"{chromium!r} is not an executable" if chromium else "no chromium on PATH"
        raise InputError(f"{where}: install Debian's package (apt-get install -y chromium) or pass its path")
    return found


def screenshot(
    tracking_uri: str,
    experiment: str,
    out: str | Path,
    *,
    chromium: str | None = None,
    window_size: str = "2200,1100",
    wait_ms: int = 20000,
    cwd: str | Path | None = None,
) -> Path:
    """A PNG at ``out`` of experiment ``experiment``'s comparison view (runs sorted by ``test_auroc``, metric columns
    shown; :func:`detectors.evaluation.tracking.view_url`) as the MLflow UI shows it: served by the tracking server
    itself when ``tracking_uri`` names one, else by an ``mlflow server`` started on the store for the shot. A missing
    experiment or Chromium is an :class:`InputError` saying what to do."""
    from mlflow import MlflowClient

    from detectors.evaluation.tracking import view_url

    browser = find_chromium(chromium)
    found = MlflowClient(tracking_uri).get_experiment_by_name(experiment)
    if found is None:
        raise InputError(
            f"no experiment {experiment!r} in {tracking_uri}: run the evaluate stage first (dvc repro evaluate)"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remote = tracking_uri.startswith(("http://", "https://"))
    with (
        tempfile.TemporaryDirectory() as tmp,
        (
            contextlib.nullcontext(tracking_uri.rstrip("/"))
            if remote
            else mlflow_server(tracking_uri, Path(tmp) / "server.log", cwd=cwd)
        ) as base,
    ):
        # a fresh browser profile: no column choice of an earlier visit
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={tmp}/profile",
                f"--window-size={window_size}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out}",
                view_url(base, found.experiment_id),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=180,
        )
    return out
