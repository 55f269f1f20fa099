"""Resumable shards: finished work survives, a new configuration clears it, errors are retried, and too
many errors stop the run without losing what is finished."""

from __future__ import annotations

import logging

import numpy as np
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
    # never silently skipped on resume
    with pytest.raises(RuntimeError, match="shard 0 .* returned without writing it"):
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


def _corrupt(path, offset: int = -1) -> None:
    """Flip the byte of ``path`` at ``offset`` (from the end when negative): the size stays, the content does not."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_shard_or_sidecar_that_is_not_what_was_written_is_computed_again_alone(tmp_path, caplog):
    """A truncated shard, a truncated sidecar, a shard whose bytes changed but still parse, an unreadable entry: each
    is named in the log and is the only work left; the finished shards around them are kept."""
    table = pd.DataFrame({"id": [f"r{i}" for i in range(10)]})
    store = ShardStore(tmp_path, {"a": 1})
    for k in range(5):
        chunk = table.iloc[2 * k : 2 * k + 2]
        store.write_arrays(k, ".hidden.safetensors", {i: np.full((2, 3), k, np.float16) for i in chunk["id"]})
        store.write(k, chunk.assign(status="ok", y=[1.5, 2.5]))
    assert store.todo(table, 2) == []
    _truncate(store.path(1))
    _truncate(store.sidecar(2, ".hidden.safetensors"))
    changed = store.read(range(3, 4)).assign(y=[1.5, 9.5])  # a valid parquet, not the one its entry records
    changed.to_parquet(store.path(3), index=False)
    store.entry(4).write_text("{")
    caplog.set_level(logging.WARNING, "detectors.shards")
    store = ShardStore(tmp_path, {"a": 1})  # the next run
    assert [(k, rows["id"].tolist()) for k, rows in store.todo(table, 2)] == [
        (1, ["r2", "r3"]),
        (2, ["r4", "r5"]),
        (3, ["r6", "r7"]),
        (4, ["r8", "r9"]),
    ]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 4 and all("is not finished, computing it again" in m for m in logged)
    assert "shard-00001.parquet is not the file that was written" in logged[0]
    assert "shard-00002.hidden.safetensors is not the file that was written" in logged[1]
    assert "shard-00003.parquet is not the file that was written" in logged[2]
    assert "shard-00004.manifest.json cannot be read" in logged[3]
    for k, rows in store.todo(table, 2):  # computed again: a whole shard, its sidecar written anew
        store.write_arrays(k, ".hidden.safetensors", {i: np.full((2, 3), k, np.float16) for i in rows["id"]})
        store.write(k, rows.assign(status="ok", y=[1.5, 2.5]))
    assert store.todo(table, 2) == []
    frame, arrays = store.read_with_arrays(10, 2, ".hidden.safetensors", "offset")
    assert frame["y"].tolist() == [1.5, 2.5] * 5 and arrays[:, 0].tolist() == [k for k in range(5) for _ in range(4)]


def test_a_retried_shard_keeps_its_finished_records_and_arrays_and_an_unreadable_manifest_keeps_the_shards(
    tmp_path, caplog
):
    table = pd.DataFrame({"id": ["a", "b"]})
    store = ShardStore(tmp_path, {"a": 1})
    store.write_arrays(0, ".h.safetensors", {"a": np.ones((1, 2), np.float16)})
    store.write(0, table.assign(status=["ok", "error: OSError: transient"]))
    (tmp_path / "manifest.json").write_text("not json")
    caplog.set_level(logging.WARNING, "detectors.shards")
    store = ShardStore(tmp_path, {"a": 1})  # the shard's entry carries its key: it stays finished
    assert "manifest.json cannot be read" in caplog.text
    [(k, rows)] = store.todo(table, 2)
    assert (k, rows["id"].tolist()) == (0, ["b"])  # only its error
    store.write_arrays(0, ".h.safetensors", {"b": np.zeros((2, 2), np.float16)})  # the retry's arrays join the kept
    store.write(0, rows.assign(status="ok"))
    assert store.todo(table, 2) == [] and ShardStore(tmp_path, {"a": 1}).todo(table, 2) == []
    frame, arrays = store.read_with_arrays(2, 2, ".h.safetensors", "offset")
    assert frame["status"].tolist() == ["ok", "ok"] and frame["offset"].tolist() == [0, 1]
    assert arrays.tolist() == [[1, 1], [0, 0], [0, 0]]
