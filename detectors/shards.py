"""Resumable work in fixed-size shards: finished shards survive a crash and are skipped on restart.

The directory remembers the configuration it was built with; a different configuration (other
params, another LLM, another input table) clears it, so stale shards are never mixed in.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pandas as pd


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (a crash never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class ShardStore:
    def __init__(self, directory: str | Path, config: dict[str, Any]):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        digest = config_hash(config)
        manifest = self.dir / "manifest.json"
        previous = json.loads(manifest.read_text()).get("config_hash") if manifest.exists() else None
        if previous != digest:
            for stale in self.dir.glob("shard-*"):
                stale.unlink()
            write_json(manifest, {"config_hash": digest, "config": config})

    def path(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.parquet"

    def sidecar(self, index: int, suffix: str) -> Path:
        """A file that belongs to shard ``index``; write it before the shard, which marks it done."""
        return self.dir / f"shard-{index:05d}{suffix}"

    def items_done(self, n_items: int, size: int) -> int:
        """How many of ``n_items`` (in shards of ``size``) finished shards hold: where progress resumes."""
        return sum(min(size, n_items - k * size) for k in range((n_items + size - 1) // size) if self.done(k))

    def done(self, index: int) -> bool:
        return self.path(index).exists()

    def write(self, index: int, frame: pd.DataFrame) -> None:
        tmp = self.dir / f".shard-{index:05d}.parquet.part"
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, self.path(index))

    def read(self, indices: range) -> pd.DataFrame:
        frames = [pd.read_parquet(self.path(i)) for i in indices]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
