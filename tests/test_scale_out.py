"""The build stages on Ray: a cluster started in-process with 2 CPU workers builds the early and real-time sets and
the CtrlA directions of the tiny Llama exactly as the local backend does; a worker killed mid-run loses only its
shard in flight, and a shard that raises stops the run keeping every finished shard, so the next run computes only
what is missing."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import ray
import torch
import yaml
from conftest import edit_params, write_params
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_tensors

from detectors.config import load_section
from detectors.execution import LLMSpec, map_units
from detectors.shards import run_shards
from pipelines import build_early, build_realtime, extract_directions, prepare, prepare_articles
from pipelines._provenance import open_shards

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # this module's workers travel to the actors by value
RAY = {"backend": "ray", "address": None, "workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1}


@pytest.fixture(scope="module")
def cluster():
    """Ray in this process with room for 2 CPU workers (and the driver); the stages join it instead of starting one."""
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture()
def project(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, tiny_checkpoint)
    edit_params(tmp_path, "qa", limit=24)
    edit_params(tmp_path, "build_early", shard_size=4)  # six shards: both workers get several
    edit_params(tmp_path, "build_realtime", shard_size=4)
    prepare.main(["--params", "params.yaml"])
    prepare_articles.main(["--params", "params.yaml"])
    return tmp_path


def outputs(project: Path) -> dict:
    return {
        "early": pd.read_parquet(project / "data/early/early.parquet"),
        "realtime": pd.read_parquet(project / "data/realtime/realtime.parquet"),
        "hidden": load_file(project / "data/realtime/hidden.safetensors")["hidden"],
    }


def assert_same(a: dict, b: dict) -> None:
    pd.testing.assert_frame_equal(a["early"], b["early"])
    pd.testing.assert_frame_equal(a["realtime"], b["realtime"])
    assert (a["hidden"] == b["hidden"]).all()


@contextlib.contextmanager
def threads(n: int):
    """Torch threads of this process: a CPU's float reductions depend on how many threads share them, so the local
    runs compute with the one thread of each Ray worker (``cpus_per_worker: 1``) when outputs are compared bit for
    bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build(project: Path, backend: dict | None = None) -> dict:
    if backend:
        edit_params(project, "execution", **backend)
    for shards in ("data/early/shards", "data/realtime/shards"):
        for path in (project / shards).glob("*"):
            path.unlink()
    with threads(1):
        build_early.main(["--params", "params.yaml"])
        build_realtime.main(["--params", "params.yaml"])
    return outputs(project)


def shard_times(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.glob("shard-*.parquet")}


def test_map_units_starts_ray_when_none_runs_and_stops_it_after(tmp_path):
    """``address: null`` starts a Ray of its own for the stage; the units come back by index whatever their order."""
    assert not ray.is_initialized()  # runs before the module's cluster starts
    execution = load_section("execution", data={"execution": RAY})
    results = dict(map_units(list(range(5)), square_worker, execution))
    assert results == {i: i * i for i in range(5)} and not ray.is_initialized()


def square_worker():
    return lambda x: x * x


def test_map_units_joins_a_running_cluster_and_works_in_the_drivers_directory(tmp_path, monkeypatch):
    """``address: host:port`` joins a cluster another process runs (here a Python process holding a Ray of its own, so
    that no other Ray on this machine is touched); the actors work in the driver's directory (the params' relative
    paths), and the cluster keeps running after the stage."""
    assert not ray.is_initialized()
    head = (
        "import ray, sys; ray.init(address='local', num_cpus=2, include_dashboard=False); "
        "print('ADDRESS', ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read(); ray.shutdown()"
    )
    proc = subprocess.Popen([sys.executable, "-c", head], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = iter(proc.stdout.readline, "")
        address = next((line.split()[1] for line in lines if line.startswith("ADDRESS ")), None)
        assert address, f"the head process did not start Ray (exit {proc.poll()})"
        execution = load_section("execution", data={"execution": {**RAY, "address": address}})
        monkeypatch.chdir(tmp_path)
        results = dict(map_units(["a", "b", "c"], cwd_worker, execution))
        assert results == {0: ("a", str(tmp_path)), 1: ("b", str(tmp_path)), 2: ("c", str(tmp_path))}
        assert not ray.is_initialized() and proc.poll() is None  # disconnected; the cluster itself is still up
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def cwd_worker():
    return lambda unit: (unit, os.getcwd())


def test_ray_with_two_workers_builds_the_same_sets_as_local(project, cluster):
    local = build(project)
    assert (local["early"]["status"] == "ok").sum() > 12 and len(local["realtime"]) > 8
    on_ray = build(project, RAY)
    assert_same(local, on_ray)
    assert len(list((project / "data/early/shards").glob("shard-*.parquet"))) == 6


def run_early_shards(project: Path, worker_class) -> None:
    """build_early's shards of ``project`` computed by ``worker_class`` (a subclass of the stage's worker) on the
    backend its params name, without the stage's merge."""
    p = yaml.safe_load((project / "params.yaml").read_text())
    params, execution = load_section("build_early", data=p), load_section("execution", data=p)
    table = pd.read_parquet(project / "data/prepared/qa.parquet")
    llm = LLMSpec(p["paths"]["llm"], "float32", "cpu")
    store, budget = open_shards(
        "build_early",
        params,
        llm,
        {"qa": p["paths"]["qa"]},
        build_early.LIBRARIES,
        p["paths"]["early_shards"],
        len(table),
    )
    run_shards(
        store,
        table,
        params.shard_size,
        functools.partial(worker_class, llm, params, store),
        execution,
        budget,
        "test",
        "q",
    )


class RecordingWorker(build_early.ShardWorker):
    """build_early's worker, leaving a mark ``writers/<shard file>.<pid>`` for every shard it starts to write (before
    writing, so that a worker killed between writing a shard and reporting it is still known as its writer)."""

    def __call__(self, shard):
        marks = Path("writers")
        marks.mkdir(exist_ok=True)
        (marks / f"{self.store.path(shard[0]).name}.{os.getpid()}").touch()
        return super().__call__(shard)


def test_a_killed_worker_loses_only_its_shard_in_flight(project, cluster):
    """A worker killed mid-run is restarted and only its unit in flight is computed again: every shard finished before
    the kill stays as it was, except one the killed worker had written but not yet reported (its unit was still in
    flight, so Ray retries it)."""
    local = build(project)
    edit_params(project, "execution", **RAY)
    for path in (project / "data/early/shards").glob("*"):
        path.unlink()
    shards, killed, finished_before = project / "data/early/shards", [], {}

    def kill_one_worker_after_the_first_shard():
        deadline = time.time() + 600  # a loaded machine starts Ray and its actors slowly: wait for the first shard
        while not list(shards.glob("shard-*.manifest.json")) and time.time() < deadline:  # a shard is finished
            time.sleep(0.02)
        finished_before.update(shard_times(shards))
        for proc in psutil.Process().children(recursive=True):  # this session's cluster only, never another Ray's
            if " ".join(proc.cmdline()).startswith("ray::MapWorker(MapBatches(_Actor))"):
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc.pid)
                return

    killer = threading.Thread(target=kill_one_worker_after_the_first_shard)
    killer.start()
    run_early_shards(project, RecordingWorker)
    killer.join()
    assert killed, "no Ray worker was found to kill"
    after = shard_times(shards)
    assert len(after) == 6 and finished_before
    # every shard's writer is known
    assert {mark.name.rsplit(".", 1)[0] for mark in (project / "writers").iterdir()} == set(after)
    rewritten = [name for name, t in finished_before.items() if after[name] != t]
    assert all((project / "writers" / f"{name}.{killed[0]}").exists() for name in rewritten), (
        rewritten,
        finished_before,
    )
    assert len(rewritten) <= 1  # the killed worker had at most one unit in flight
    build_early.main(["--params", "params.yaml"])  # every shard is there: the stage only merges them
    assert shard_times(shards) == after
    pd.testing.assert_frame_equal(pd.read_parquet(project / "data/early/early.parquet"), local["early"])


class FailingWorker(build_early.ShardWorker):
    """build_early's worker, whose shard 2 raises (a device error, say) after the others are written."""

    def __call__(self, shard):
        if shard[0] == 2:
            time.sleep(1.0)  # the other worker finishes its shards first
            raise RuntimeError("device lost")
        return super().__call__(shard)


def test_a_shard_that_raises_stops_the_run_and_the_next_run_computes_only_what_is_missing(project, cluster):
    local = build(project)
    edit_params(project, "execution", **RAY)
    for path in (project / "data/early/shards").glob("*"):
        path.unlink()
    with pytest.raises(Exception, match="device lost"):
        run_early_shards(project, FailingWorker)
    shards = project / "data/early/shards"
    kept = shard_times(shards)
    assert "shard-00002.parquet" not in kept and len(kept) >= 1
    assert all((pd.read_parquet(shards / name)["status"] == "ok").all() for name in kept)
    build_early.main(["--params", "params.yaml"])  # the real worker: only the missing shards are computed
    assert {name: t for name, t in shard_times(shards).items() if name in kept} == kept
    pd.testing.assert_frame_equal(pd.read_parquet(project / "data/early/early.parquet"), local["early"])


def test_ctrla_directions_on_ray_equal_local(project, cluster):
    params = yaml.safe_load((project / "params.yaml").read_text())
    for concept in ("honesty", "confidence"):
        params["extract_directions"][concept]["statements"].update(limit=12)
    params["extract_directions"].update(size_curve=[4], batch_size=8)
    directions = {}
    for backend in ("local", "ray"):
        params["execution"] = {**RAY, "backend": backend}
        params["paths"]["directions"] = f"data/directions-{backend}"
        (project / "params.yaml").write_text(yaml.safe_dump(params))
        with threads(1):
            extract_directions.main(["--params", "params.yaml"])
        directions[backend] = {
            c: load_tensors(project / f"data/directions-{backend}/{c}/directions.safetensors")
            for c in ("honesty", "confidence")
        }
    for concept, tensors in directions["local"].items():
        assert set(tensors) == set(directions["ray"][concept])
        assert all((tensors[k] == directions["ray"][concept][k]).all() for k in tensors), concept


def test_rag_eval_on_ray_answers_as_local(project, cluster):
    """The RAG evaluation's run files (one per corpus × configuration, and the sweeps) spread over the actors: every
    answer, retrieval and metric as the local run's (only the wall times differ)."""
    from pipelines import index_corpus, rag_eval

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["index_corpus"]["corpora"] = {
        "facts": {"source": "qa", "id_field": None, "title_field": None, "text_field": None}
    }
    configurations = {
        name: params["rag_eval"]["configurations"][name] for name in ("no-retrieval", "single-round", "flare")
    }
    params["rag_eval"].update(
        questions=6,
        corpora=["facts"],
        configurations=configurations,
        sweep={"corpus": "facts", "query": "question"},
        max_new_tokens=4,
        frameworks=["retrorag"],
    )
    params["retrorag"].update(
        yes_words=["Y"],
        no_words=["N"],
        chat=False,
        max_iterations=2,
        answer_tokens=4,
        reason_tokens=6,
        evidence_tokens=5,
        evidence_words=8,
        answer_context="{evidence}\n",
        direct_context="{evidence}\n",
    )
    results = {}
    for backend in ("local", "ray"):
        params["execution"] = {**RAY, "backend": backend}
        params["paths"].update(rag_runs=f"data/rag/runs-{backend}", rag_metrics=f"data/metrics/rag-{backend}.json")
        (project / "params.yaml").write_text(yaml.safe_dump(params))
        with threads(1):
            index_corpus.main(["--params", "params.yaml"])
            rag_eval.main(["--params", "params.yaml"])
        runs = {}
        root = project / f"data/rag/runs-{backend}/facts"
        # the tuning's runs: tune-val/<configuration>/<j>
        for run in sorted({p.parent for p in root.rglob("shard-*.parquet")}):
            stored = pd.concat([pd.read_parquet(shard) for shard in sorted(run.glob("shard-*.parquet"))])
            runs[str(run.relative_to(root))] = [
                {k: v for k, v in json.loads(line).items() if k not in ("wall_s", "seconds")} for line in stored["line"]
            ]
        metrics = json.loads((project / f"data/metrics/rag-{backend}.json").read_text())
        results[backend] = (
            runs,
            {
                name: {k: v for k, v in m.items() if "wall" not in k and "second" not in k}
                for name, m in metrics["facts"].items()
            },
        )
    tuned = {name for name in results["local"][0] if name.startswith("tune-val/")}
    assert tuned and {name.rsplit("/", 1)[0] for name in tuned} == {"tune-val/flare"}  # nothing to choose elsewhere
    assert set(results["local"][0]) - tuned == {
        "no-retrieval",
        "single-round",
        "flare",
        "retrorag",
        "sweep",
        "sweep-val",
    }
    # RetroRAG's own row: one per iteration
    assert all(1 <= len(line["retrievals"]) <= 2 for line in results["local"][0]["retrorag"])
    # validation: every val question
    assert all(
        len(lines) == 6 for name, lines in results["local"][0].items() if name != "sweep-val" and name not in tuned
    )
    assert results["ray"] == results["local"]


@pytest.mark.parametrize(
    "device, gpus, expected",
    [
        ("auto", 0, "cpu"),
        ("auto", 1, "cuda"),
        ("cpu", 0, "cpu"),
        ("cuda", 0.5, "cuda"),
        ("cuda:1", 1, "cuda:1.*CUDA_VISIBLE_DEVICES"),
        ("cuda", 0, "gpus_per_worker = 0"),
        ("cpu", 1, "set gpus_per_worker to 0"),
    ],
)
def test_the_workers_device_follows_their_gpus_and_contradictions_are_refused(device, gpus, expected):
    from detectors.errors import InputError
    from detectors.execution import worker_device

    execution = load_section("execution", data={"execution": {**RAY, "gpus_per_worker": gpus}})
    local = load_section("execution", data={"execution": {**RAY, "backend": "local"}})
    assert worker_device(device, local) == device  # the local backend loads where llm.device says
    if expected in ("cpu", "cuda"):
        assert worker_device(device, execution) == expected
    else:
        with pytest.raises(InputError, match=expected):
            worker_device(device, execution)


def test_bad_execution_params_are_refused_naming_the_key():
    from detectors.config.core import ParamsError

    for key, value, message in [
        ("backend", "dask", "backend"),
        ("workers", 0, "workers"),
        ("gpus_per_worker", -1, "gpus_per_worker"),
        ("address", "cluster", "address"),
    ]:
        with pytest.raises(ParamsError, match=f"execution.{message}"):
            load_section("execution", data={"execution": {**RAY, key: value}})
