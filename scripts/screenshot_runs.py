"""Screenshot of the comparison as a user sees it in the MLflow UI (not part of the test run; needs Debian's
``chromium``: ``apt-get install -y chromium``).

Starts ``mlflow server`` (the venv's CLI) on a free loopback port against the project's store, opens the comparison
experiment's runs table in its comparison view (sorted by ``test_auroc``, metric columns shown; see
:func:`detectors.evaluation.tracking.view_url`) in headless Chromium, saves a PNG under ``data/screenshots/`` and
prints its path. Usage: ``python scripts/screenshot_runs.py [--dataset early|realtime] [--params params.yaml]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from detectors.config import load_section  # noqa: E402
from detectors.evaluation.tracking import view_url  # noqa: E402
from detectors.registry.store import configure  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {base} not healthy after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="early", choices=["early", "realtime"])
    parser.add_argument("--params", default=str(ROOT / "params.yaml"), help="params file naming the store and the experiment prefix")
    parser.add_argument("--out", default=None, help="PNG path (default data/screenshots/runs-<dataset>.png next to the params file)")
    parser.add_argument("--window-size", default="2200,1100")
    parser.add_argument("--wait-ms", type=int, default=20000, help="virtual time the page gets to load before the shot")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: install Debian's package (apt-get install -y chromium)")
    params = Path(args.params).resolve()
    uri = configure(load_section("mlflow", params).tracking_uri, params.parent)  # absolute, re-anchored if the project moved
    name = f"{load_section('evaluate', params).experiment}-{args.dataset}"
    out = Path(args.out) if args.out else params.parent / "data" / "screenshots" / f"runs-{args.dataset}.png"
    out.parent.mkdir(parents=True, exist_ok=True)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [str(mlflow_cli), "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=params.parent,
    )  # fmt: skip
    try:
        wait_healthy(base, server, timeout=120)
        query = urllib.parse.urlencode({"experiment_name": name})
        try:
            with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?{query}", timeout=30) as response:
                experiment_id = json.loads(response.read())["experiment"]["experiment_id"]
        except urllib.error.HTTPError as err:
            raise SystemExit(f"no experiment {name!r} in {uri}: run the evaluate stage first (dvc repro evaluate)") from err
        with tempfile.TemporaryDirectory() as profile:  # a fresh browser profile: no column choice of an earlier visit
            subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
                 f"--window-size={args.window_size}", f"--virtual-time-budget={args.wait_ms}", f"--screenshot={out}",
                 view_url(base, experiment_id)],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=180,
            )  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    print(out)
    return out


if __name__ == "__main__":
    main()
