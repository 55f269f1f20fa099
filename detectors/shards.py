"""Resumable work in fixed-size shards: finished shards survive a crash and are skipped on restart.

The directory remembers the configuration it was built with; a different configuration (other
params, another LLM, another input table) clears it, so stale shards are never mixed in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
from tqdm import tqdm

from detectors.io import write_json

log = logging.getLogger(__name__)


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ShardStore:
    """Shards ``shard-NNNNN.parquet`` of a table processed ``size`` rows at a time, under one configuration."""

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
        return sum(min(size, n_items - k * size) for k in range(self.count(n_items, size)) if self.done(k))

    def done(self, index: int) -> bool:
        return self.path(index).exists()

    def write(self, index: int, frame: pd.DataFrame) -> None:
        tmp = self.dir / f".shard-{index:05d}.parquet.part"
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, self.path(index))

    def read(self, indices: range) -> pd.DataFrame:
        frames = [pd.read_parquet(self.path(i)) for i in indices]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    @staticmethod
    def count(n_items: int, size: int) -> int:
        return (n_items + size - 1) // size

    def pending(self, table: pd.DataFrame, size: int, desc: str, unit: str) -> Iterator[tuple[int, pd.DataFrame]]:
        """The unfinished shards of ``table`` as ``(index, rows)``, with a progress bar that starts at the
        items finished shards hold. The caller writes shard ``index`` before asking for the next one."""
        n_shards = self.count(len(table), size)
        todo = [k for k in range(n_shards) if not self.done(k)]
        log.info("%s: %d %s in %d shards, %d to do", desc, len(table), unit, n_shards, len(todo))
        with tqdm(total=len(table), initial=self.items_done(len(table), size), desc=desc, unit=unit) as bar:
            for k in todo:
                chunk = table.iloc[k * size : (k + 1) * size]
                yield k, chunk
                if not self.done(k):
                    raise RuntimeError(f"shard {k} of {self.dir} was not written before the next one was asked for")
                bar.update(len(chunk))

    def read_all(self, n_items: int, size: int) -> pd.DataFrame:
        """Every shard of a table of ``n_items`` rows, in order (all must be done)."""
        return self.read(range(self.count(n_items, size)))
