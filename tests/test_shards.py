"""Resumable shards: finished work survives, a new configuration clears it, progress resumes where it was."""

from __future__ import annotations

import pandas as pd

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
