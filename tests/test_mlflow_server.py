"""The MLflow UI's server on a store the tiny pipeline built: ``mlflow server`` (the venv's CLI) on a free loopback
port, checked through its REST API as the UI reads it: the comparison runs with their tags, the registered detectors
with their ``champion`` aliases, and the experiment kind that makes the UI open experiments on their runs table; and a
team's shared registry: the register stage writes to a server of its own and ``load_detector`` serves from it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import mlflow
import pytest
import yaml

from detectors import load_detector
from detectors.registry import store
from detectors.registry.store import CUSTOM_MODEL_DEVELOPMENT, EXPERIMENT_KIND_TAG
from pipelines import register as register_stage
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


@contextlib.contextmanager
def mlflow_server(backend: str, log: Path, cwd: Path, artifacts: Path | None = None) -> Iterator[str]:
    """``mlflow server`` (the venv's CLI) on ``backend`` at a free loopback port, serving the artifacts of new experiments
    from ``artifacts`` when given; yields its base URL once healthy and kills it (and its workers) afterwards."""
    port = free_port()
    cmd = [str(MLFLOW), "server", "--backend-store-uri", backend, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--artifacts-destination", str(artifacts)] if artifacts else []
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)  # its own group
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


@pytest.fixture(scope="module")
def server(pipeline, tmp_path_factory):  # noqa: F811
    """``mlflow server`` on the pipeline's store (what the UI shows)."""
    with mlflow_server(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}", tmp_path_factory.mktemp("server") / "server.log", pipeline) as base:
        yield base


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


@pytest.fixture()
def team_server(tmp_path):
    """A team's registry: an empty ``mlflow server`` of its own (sqlite here, PostgreSQL in a team), artifacts proxied to its
    own directory; yields its URL and that directory."""
    with mlflow_server(f"sqlite:///{tmp_path / 'team.db'}", tmp_path / "team.log", tmp_path, tmp_path / "team-artifacts") as base:
        yield base, tmp_path / "team-artifacts"


def test_a_team_server_receives_the_pipelines_detectors_and_serves_them(pipeline, tiny_llm, team_server, tmp_path):  # noqa: F811
    url, artifacts = team_server
    os.chdir(pipeline)
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["mlflow"] = {"tracking_uri": url, "artifact_root": None}  # the server chooses where artifacts go
    params["paths"].update(registry_early=str(tmp_path / "early.json"), registry_realtime=str(tmp_path / "realtime.json"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    local_uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    try:
        register_stage.main(["--params", str(tmp_path / "params.yaml")])
        first = json.loads((tmp_path / "early.json").read_text())["dior-early"]
        assert first["version"] == 1 and first["alias_moved"]
        assert any(artifacts.rglob("*.safetensors"))  # the weights went to the server's artifact store, not the project's
        served = load_detector("dior-early", alias="champion", tracking_uri=url, llm=tiny_llm)
        local = load_detector("dior-early", alias="champion", tracking_uri=local_uri, llm=tiny_llm)
        for question in ("The capital of Spain is", "The river of Paris is"):
            assert served.assess(question).probability == local.assess(question).probability
        realtime = load_detector("dior-realtime", tracking_uri=url, llm=tiny_llm)
        assert realtime.threshold == load_detector("dior-realtime", tracking_uri=local_uri, llm=tiny_llm).threshold
        register_stage.main(["--params", str(tmp_path / "params.yaml")])  # the champion rule, through the server
        second = json.loads((tmp_path / "early.json").read_text())["dior-early"]
        assert second["version"] == 2 and second["alias_moved"]
        assert int(mlflow.MlflowClient(url, url).get_model_version_by_alias("dior-early", "champion").version) == 2
    finally:
        store.configure(local_uri)  # the other tests read the project's store
