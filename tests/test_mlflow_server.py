"""The MLflow UI's server on a store the tiny pipeline built: ``mlflow server`` (the venv's CLI) on a free loopback
port, checked through its REST API as the UI reads it: the comparison runs with their tags, the registered detectors
with their ``champion`` aliases, and the experiment kind that makes the UI open experiments on their runs table; a
team's shared registry: the register stage writes to a server of its own and ``load_detector`` serves from it; and a
tracking URI that names no MLflow server: every entry point fails at its one health check, in one line naming it."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
import yaml
from conftest import ROOT, copy_project

from detectors import cli, load_detector
from detectors.mlflow_ui import free_port, mlflow_server
from detectors.registry import store
from detectors.registry.store import CUSTOM_MODEL_DEVELOPMENT, EXPERIMENT_KIND_TAG
from pipelines import register as register_stage


def call(base: str, path: str, body: dict | None = None) -> dict:
    """GET (``body`` None) or POST JSON to the server's REST API."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def project(pipeline, tmp_path_factory) -> Path:
    """A copy of the tiny pipeline's project (tests/conftest.py) for this module's server: what a server writes to the
    store it serves or to its working directory never reaches the pipeline other modules read."""
    return copy_project(pipeline, tmp_path_factory.mktemp("served") / "project")


@pytest.fixture(scope="module")
def server(project, tmp_path_factory):
    """``mlflow server`` on the project's store (what the UI shows)."""
    with mlflow_server(
        f"sqlite:///{project / 'data/mlflow/mlflow.db'}",
        tmp_path_factory.mktemp("server") / "server.log",
        cwd=project,
    ) as base:
        yield base


def experiment(base: str, name: str) -> dict:
    return call(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + name)["experiment"]


def test_comparison_runs_are_served_flat_with_their_tags(server, project):
    metrics = {
        "early": json.loads((project / "data/metrics/evaluate_early.json").read_text()),  # {level: {scorer: metrics}}
        "realtime": json.loads((project / "data/metrics/evaluate_realtime.json").read_text()),
    }
    for dataset, by_level in metrics.items():
        exp = experiment(server, f"detector-evaluation-{dataset}")
        assert {t["key"]: t["value"] for t in exp["tags"]}[EXPERIMENT_KIND_TAG] == CUSTOM_MODEL_DEVELOPMENT
        found = call(
            server,
            "/api/2.0/mlflow/runs/search",
            {
                "experiment_ids": [exp["experiment_id"]],
                "order_by": ["metrics.test_auroc DESC"],
                "max_results": 1000,
            },
        )["runs"]
        rows = {}
        for run in found:
            tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
            # flat: the runs table lists every scorer without expanding anything
            assert "mlflow.parentRunId" not in tags
            assert (
                tags["dataset"] == dataset
                and tags["kind"] in {"detector", "baseline", "trained baseline"}
                and tags["llm"]
            )
            assert tags["mlflow.runName"] == f"{tags['detector']} · {tags['level']}"
            rows[tags["level"], tags["detector"]] = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        # one run per scorer × level
        assert set(rows) == {(level, scorer) for level, by in by_level.items() for scorer in by}
        for (level, scorer), logged in rows.items():
            assert logged["test_auroc"] == pytest.approx(by_level[level][scorer]["auroc"])
        order = [m["value"] for run in found for m in run["data"]["metrics"] if m["key"] == "test_auroc"]
        assert order == sorted(order, reverse=True)  # the server sorts by test_auroc, as the UI asks it to


def test_registered_detectors_have_champion_aliases(server, project):
    models = call(server, "/api/2.0/mlflow/registered-models/search?max_results=100")["registered_models"]
    outputs = {p.stem: json.loads(p.read_text()) for p in (project / "data/registry").glob("*.json")}  # one a name
    assert {"dior-early", "dior-early-extended", "dior-realtime"} <= set(outputs) <= {m["name"] for m in models}
    for name, registered in outputs.items():
        version = call(server, f"/api/2.0/mlflow/registered-models/alias?name={name}&alias=champion")["model_version"]
        assert int(version["version"]) == registered["champion_version"]
        assert {t["key"]: t["value"] for t in version["tags"]}["val_digest"] == registered["val_digest"]
        registry = experiment(server, "detector-registry")  # the registry's experiment opens on its runs table too
        assert {t["key"]: t["value"] for t in registry["tags"]}[EXPERIMENT_KIND_TAG] == CUSTOM_MODEL_DEVELOPMENT


@pytest.fixture()
def team_server(tmp_path):
    """A team's registry: an empty ``mlflow server`` of its own (sqlite here, PostgreSQL in a team), artifacts proxied
    to its own directory; yields its URL and that directory."""
    with mlflow_server(
        f"sqlite:///{tmp_path / 'team.db'}", tmp_path / "team.log", cwd=tmp_path, artifacts=tmp_path / "team-artifacts"
    ) as base:
        yield base, tmp_path / "team-artifacts"


def test_a_team_server_receives_the_pipelines_detectors_and_serves_them(pipeline_copy, tiny_llm, team_server, tmp_path):
    url, artifacts = team_server
    pipeline = pipeline_copy  # the register stage runs in it: its own copy, the working directory
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["mlflow"] = {"tracking_uri": url, "artifact_root": None}  # the server chooses where artifacts go
    params["paths"]["registry"] = str(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    local_uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    try:
        register_stage.main(["--params", str(tmp_path / "params.yaml")])
        first = json.loads((tmp_path / "dior-early.json").read_text())
        assert first["version"] == 1 and first["alias_moved"]
        # the weights went to the server's artifact store, not the project's
        assert any(artifacts.rglob("*.safetensors"))
        served = load_detector("dior-early", alias="champion", tracking_uri=url, llm=tiny_llm)
        local = load_detector("dior-early", alias="champion", tracking_uri=local_uri, llm=tiny_llm)
        for question in ("The capital of Spain is", "The river of Paris is"):
            assert served.assess(question).probability == local.assess(question).probability
        realtime = load_detector("dior-realtime", tracking_uri=url, llm=tiny_llm)
        assert realtime.threshold == load_detector("dior-realtime", tracking_uri=local_uri, llm=tiny_llm).threshold
        register_stage.main(["--params", str(tmp_path / "params.yaml")])  # the champion rule, through the server
        second = json.loads((tmp_path / "dior-early.json").read_text())
        assert second["version"] == 2 and not second["alias_moved"]  # the same scores: a tie waits as challenger
        client = mlflow.MlflowClient(url, url)
        assert int(client.get_model_version_by_alias("dior-early", "champion").version) == 1
        assert int(client.get_model_version_by_alias("dior-early", "challenger").version) == 2
    finally:
        store.configure(local_uri)  # the other tests read the project's store


@contextlib.contextmanager
def not_found_server() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A local HTTP server that answers 404 to everything (another service on that port, a proxy's error page); its
    URL and the requests it received, as (method, path), in order."""
    received: list[tuple[str, str]] = []

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            received.append((self.command, self.path))
            self.send_error(404)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_a_tracking_uri_without_an_mlflow_server_fails_fast_in_one_line(tmp_path, capsys):
    """Nothing listening, or a server answering 404: the store's configuration (so load_detector, the CLI and the
    register stage) fails at its one health check, naming the URI, instead of MLflow's minutes of retries and a raw
    404 traceback: the server answering 404 is asked ``GET /health`` once per entry point, and nothing else."""
    dead = f"http://127.0.0.1:{free_port()}"
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    with not_found_server() as (wrong, received):

        def asked() -> list[tuple[str, str]]:
            """The requests the 404 server received since the last call (those to the dead port reach nothing)."""
            taken = received[:]
            del received[:]
            return taken

        cases = {
            dead: (
                rf"no MLflow tracking server answers at {dead} "
                r"\(\[Errno 111\] Connection refused, 5 s timeout\): start it"
            ),
            wrong: rf"{wrong} answered HTTP 404 to GET /health: no MLflow tracking server is there; start it",
        }
        for uri, message in cases.items():
            with pytest.raises(store.TrackingServerError, match=message):
                store.configure(uri)
            requests = [asked()]
            with pytest.raises(store.TrackingServerError, match=message):
                load_detector("dior-early", tracking_uri=uri)
            requests.append(asked())
            assert cli.main(["promote", "dior-early", "1", "--tracking-uri", uri]) == 1
            requests.append(asked())
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and err.startswith("dynrag promote: TrackingServerError: ") and uri in err
            params["mlflow"] = {"tracking_uri": uri, "artifact_root": None}
            (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
            done = subprocess.run(
                [sys.executable, "-m", "pipelines.register", "--params", "params.yaml"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,  # a guard against a hang, not a bound the test asserts
            )
            requests.append(asked())
            assert done.returncode == 1, done.stderr
            last = done.stderr.strip().splitlines()[-1]
            assert "Traceback" not in done.stderr and last.startswith("TrackingServerError: ") and uri in last
            if uri == wrong:  # each entry point stopped at its one health check: no retry, no other request
                assert requests == [[("GET", "/health")]] * 4
