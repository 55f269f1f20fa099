"""Resumable shards: finished work survives, a new configuration clears it, errors are retried, and too
many errors stop the run without losing what is finished."""

from __future__ import annotations

import pandas as pd
import pytest

from detectors.config.common import ExecutionParams
from detectors.errors import RecordError
from detectors.shards import FailedRecordsError, FailureBudget, ShardStore, failure_status, run_shards, status_counts

LOCAL = ExecutionParams(backend="local", address=None, workers=1, gpus_per_worker=0, cpus_per_worker=1)


def rows(ids, status="ok", **cols) -> pd.DataFrame:
    return pd.DataFrame({"id": list(ids), "status": status, **cols})


def test_shards_resume_and_are_cleared_by_another_config(tmp_path):
    store = ShardStore(tmp_path, {"a": 1})
    for k in (0, 2):
        store.write(k, rows([f"r{k}"]))
    (tmp_path / "shard-00002.hidden.safetensors").write_bytes(b"sidecar")
    assert [store.done(k) for k in range(3)] == [True, False, True]
    again = ShardStore(tmp_path, {"a": 1})
    assert again.read(range(0, 1))["id"].tolist() == ["r0"]
    other = ShardStore(tmp_path, {"a": 2})  # another configuration: stale work is gone, sidecars too
    assert not any(other.done(k) for k in range(3)) and not list(tmp_path.glob("shard-*"))


def test_todo_is_the_unfinished_shards_and_run_shards_requires_each_to_be_written(tmp_path):
    table = pd.DataFrame({"id": [f"r{i}" for i in range(10)], "x": range(10)})
    store = ShardStore(tmp_path, {"a": 1})
    store.write(1, rows(["r4", "r5", "r6", "r7"], y=[4, 5, 6, 7]))  # finished by an earlier, killed run
    assert [(k, chunk["x"].tolist()) for k, chunk in store.todo(table, 4)] == [(0, [0, 1, 2, 3]), (2, [8, 9])]

    def worker():
        def compute(shard):
            k, chunk = shard
            store.write(k, chunk.assign(status="ok", y=chunk["x"]))
            return store.read(range(k, k + 1))[["id", "status"]]

        return compute

    run_shards(store, table, 4, worker, LOCAL, FailureBudget(10, 0.0, "x", tmp_path), "test", "item")
    assert store.read_all(10, 4)["y"].tolist() == list(range(10)) and store.todo(table, 4) == []
    fresh = ShardStore(tmp_path / "other", {"a": 1})
    with pytest.raises(
        RuntimeError, match="shard 0 .* returned without writing it"
    ):  # never silently skipped on resume
        run_shards(
            fresh,
            table,
            4,
            lambda: lambda shard: shard[1].assign(status="ok"),
            LOCAL,
            FailureBudget(10, 0.0, "x", tmp_path),
            "test",
            "item",
        )


def test_errors_are_retried_alone_and_merged_in_order_while_skipped_records_are_final(tmp_path):
    table = pd.DataFrame({"id": ["a", "b", "c", "d"]})
    store = ShardStore(tmp_path, {"a": 1})
    first = [failure_status(OSError("disk gone")), "ok", failure_status(RecordError("no entity")), "ok"]
    store.write(0, table.assign(status=first, y=[None, 2, None, 4]))
    assert first[0] == "error: OSError: disk gone" and first[2] == "skipped: no entity"
    store = ShardStore(tmp_path, {"a": 1})  # the next run
    [(k, chunk)] = store.todo(table, 4)
    assert (k, chunk["id"].tolist()) == (0, ["a"])  # only the error, not the skipped record
    store.write(0, rows(["a"], y=[1]))
    merged = store.read_all(4, 4)
    assert merged["id"].tolist() == ["a", "b", "c", "d"] and merged["y"].tolist()[:2] == [1, 2]
    assert merged["status"].tolist() == ["ok", "ok", "skipped: no entity", "ok"]
    assert ShardStore(tmp_path, {"a": 1}).todo(table, 4) == []
    counts = status_counts(merged)
    assert counts["skipped"] == 1 and counts["failed"] == 0 and counts["skip_reasons"] == {"no entity": 1}


def test_failure_budget_stops_once_the_share_can_no_longer_be_met():
    budget = FailureBudget(total=40, max_share=0.05, key="build_early.max_failed_share", directory="data/early/shards")
    budget.add(rows(["a", "b"], status="error: OSError: transient"))  # 2 of 40 = 5 %: allowed
    budget.add(rows(["c"], status="skipped: empty question"))  # skipped records never count
    with pytest.raises(
        FailedRecordsError, match=r"3 of 40 records failed.*build_early.max_failed_share = 0.05.*a: OSError: transient"
    ):
        budget.add(rows(["d", "e"], status=["ok", "error: RuntimeError: CUDA error"]))
