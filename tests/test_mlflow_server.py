"""The MLflow UI's server on a store the tiny pipeline built: ``mlflow server`` (the venv's CLI) on a free loopback
port, checked through its REST API as the UI reads it: the comparison runs with their tags, the registered detectors
with their ``champion`` aliases, and the experiment kind that makes the UI open experiments on their runs table."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from detectors.registry.store import CUSTOM_MODEL_DEVELOPMENT, EXPERIMENT_KIND_TAG
from test_pipeline import pipeline  # noqa: F401  (the module-scoped fixture: every stage once on the tiny Llama)

MLFLOW = Path(sys.executable).with_name("mlflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, path: str, body: dict | None = None) -> dict:
    """GET (``body`` None) or POST JSON to the server's REST API."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(pipeline, tmp_path_factory):  # noqa: F811
    """``mlflow server`` on the pipeline's store; yields its base URL and kills it afterwards."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    db = pipeline / "data/mlflow/mlflow.db"
    cmd = [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{db}", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=pipeline, start_new_session=True)  # its own group
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not become healthy (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:  # the server and its uvicorn worker and job runner
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def experiment(base: str, name: str) -> dict:
    return call(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + name)["experiment"]


def test_comparison_runs_are_served_flat_with_their_tags(server, pipeline):  # noqa: F811
    metrics = {
        "early": json.loads((pipeline / "data/metrics/evaluate_early.json").read_text()),  # {level: {scorer: metrics}}
        "realtime": json.loads((pipeline / "data/metrics/evaluate_realtime.json").read_text()),
    }
    for dataset, by_level in metrics.items():
        exp = experiment(server, f"detector-evaluation-{dataset}")
        assert {t["key"]: t["value"] for t in exp["tags"]}[EXPERIMENT_KIND_TAG] == CUSTOM_MODEL_DEVELOPMENT
        found = call(server, "/api/2.0/mlflow/runs/search", {
            "experiment_ids": [exp["experiment_id"]], "order_by": ["metrics.test_auroc DESC"], "max_results": 1000,
        })["runs"]  # fmt: skip
        rows = {}
        for run in found:
            tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
            assert "mlflow.parentRunId" not in tags  # flat: the runs table lists every scorer without expanding anything
            assert tags["dataset"] == dataset and tags["kind"] in {"detector", "baseline"} and tags["llm"]
            assert tags["mlflow.runName"] == f"{tags['detector']} · {tags['level']}"
            rows[tags["level"], tags["detector"]] = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert set(rows) == {(level, scorer) for level, by in by_level.items() for scorer in by}  # one run per scorer × level
        for (level, scorer), logged in rows.items():
            assert logged["test_auroc"] == pytest.approx(by_level[level][scorer]["auroc"])
        order = [m["value"] for run in found for m in run["data"]["metrics"] if m["key"] == "test_auroc"]
        assert order == sorted(order, reverse=True)  # the server sorts by test_auroc, as the UI asks it to


def test_registered_detectors_have_champion_aliases(server, pipeline):  # noqa: F811
    models = call(server, "/api/2.0/mlflow/registered-models/search?max_results=100")["registered_models"]
    early = json.loads((pipeline / "data/registry/early.json").read_text())  # one entry per early detector
    outputs = {entry["name"]: entry for entry in early.values()}
    outputs["dior-realtime"] = json.loads((pipeline / "data/registry/dior-realtime.json").read_text())
    assert {"dior-early", "dior-early-extended", "dior-realtime"} <= set(outputs) <= {m["name"] for m in models}
    for name, registered in outputs.items():
        version = call(server, f"/api/2.0/mlflow/registered-models/alias?name={name}&alias=champion")["model_version"]
        assert int(version["version"]) == registered["champion_version"]
        assert {t["key"]: t["value"] for t in version["tags"]}["val_digest"] == registered["val_digest"]
        registry = experiment(server, "detector-registry")  # the registry's experiment opens on its runs table too
        assert {t["key"]: t["value"] for t in registry["tags"]}[EXPERIMENT_KIND_TAG] == CUSTOM_MODEL_DEVELOPMENT
