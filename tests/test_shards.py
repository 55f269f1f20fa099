"""Resumable shards: finished work survives, a new configuration clears it, progress resumes where it was."""

from __future__ import annotations

import pandas as pd
import pytest

from detectors.shards import ShardStore


def test_shards_resume_and_are_cleared_by_another_config(tmp_path):
    store = ShardStore(tmp_path, {"a": 1})
    for k in (0, 2):  # 10 items in shards of 4: sizes 4, 4, 2
        store.write(k, pd.DataFrame({"x": [k]}))
    (tmp_path / "shard-00002.hidden.safetensors").write_bytes(b"sidecar")
    assert [store.done(k) for k in range(3)] == [True, False, True]
    assert store.items_done(10, 4) == 4 + 2
    again = ShardStore(tmp_path, {"a": 1})
    assert again.read(range(0, 1))["x"].tolist() == [0]
    other = ShardStore(tmp_path, {"a": 2})  # another configuration: stale work is gone, sidecars too
    assert not any(other.done(k) for k in range(3)) and not list(tmp_path.glob("shard-*"))
    assert other.items_done(10, 4) == 0


def test_pending_yields_only_unfinished_shards_and_requires_each_to_be_written(tmp_path):
    table = pd.DataFrame({"x": range(10)})
    store = ShardStore(tmp_path, {"a": 1})
    store.write(1, pd.DataFrame({"y": [4, 5, 6, 7]}))  # finished by an earlier, killed run
    seen = []
    for k, chunk in store.pending(table, 4, "test", "item"):
        seen.append((k, chunk["x"].tolist()))
        store.write(k, chunk.assign(y=chunk["x"]))
    assert seen == [(0, [0, 1, 2, 3]), (2, [8, 9])]
    assert store.read_all(10, 4)["y"].tolist() == list(range(10))
    fresh = ShardStore(tmp_path / "other", {"a": 1})
    with pytest.raises(RuntimeError, match="shard 0 .* was not written"):
        for _ in fresh.pending(table, 4, "test", "item"):
            pass  # forgets to write: the next shard is refused instead of being silently skipped on resume
