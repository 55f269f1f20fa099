"""Resumable work in fixed-size shards: finished shards survive a crash and are skipped on restart.

The directory remembers the configuration it was built with (the stage's key: params, LLM, inputs,
code); a different configuration clears it, so stale shards are never mixed in. Each shard has a manifest entry,
``shard-NNNNN.manifest.json``, written after it: the sha256 of the shard and of its sidecars, and the key's hash. A
shard is finished only when its entry is readable, was written under the same key and matches its files; any other
shard on disk (truncated, corrupted, its sidecar unreadable, killed before its entry) is logged by name and computed
again, alone. (One entry per shard, not one file for all: parallel workers never write the same file.)

Every record has an ``id`` and a ``status``: ``ok``; ``skipped: <why>`` when the record cannot be used
(a :class:`RecordError`: deterministic, final, reported); or ``error: <what>`` for anything else (a
transient I/O or device error, a bug). Errors are never final: the next run computes those records
again, and a stage stops once errors exceed its allowed share (:class:`FailureBudget`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.numpy import load_file, save_file

from detectors.config.common import ExecutionParams
from detectors.errors import RecordError
from detectors.execution import map_units
from detectors.io import changed_file, file_digests, write_json
from detectors.progress import progress

log = logging.getLogger(__name__)

OK = "ok"
SKIPPED = "skipped: "
ERROR = "error: "


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def failure_status(err: Exception) -> str:
    """The status of a record that raised ``err``: skipped for a :class:`RecordError`, else an error.
    Running out of device memory is re-raised: it is the batch size's problem, not the record's."""
    if isinstance(err, torch.OutOfMemoryError):
        raise err
    return SKIPPED + str(err) if isinstance(err, RecordError) else f"{ERROR}{type(err).__name__}: {err}"


def is_error(status: pd.Series) -> pd.Series:
    return status.str.startswith(ERROR)


def status_counts(frame: pd.DataFrame) -> dict[str, Any]:
    """How many records of a stage's output are ok, skipped and failed, for its report (reasons with numbers
    masked, the first failures)."""
    skipped, failed = frame[frame["status"].str.startswith(SKIPPED)], frame[is_error(frame["status"])]
    return {
        "records": int(len(frame)),
        "ok": int((frame["status"] == OK).sum()),
        "skipped": int(len(skipped)),
        "skip_reasons": skipped["status"]
        .str.removeprefix(SKIPPED)
        .str.replace(r"\d+", "N", regex=True)
        .value_counts()
        .to_dict(),
        "failed": int(len(failed)),
        "failures": failed[["id", "status"]].head(50).to_dict("records"),
    }


class FailedRecordsError(RuntimeError):
    """More records failed than a stage allows; the finished ones are kept and the failed ones retried."""


class FailureBudget:
    """Stops a stage as soon as its errors exceed ``max_share`` of its ``total`` records (the final share
    can then no longer be under it), so a sticky error (a broken GPU, a full disk) ends the run early
    instead of turning the rest of it into error rows."""

    def __init__(self, total: int, max_share: float, key: str, directory: str | Path):
        self.total, self.max_share, self.key, self.dir = total, max_share, key, directory
        self.errors: list[tuple[str, str]] = []

    def add(self, rows: pd.DataFrame) -> None:
        failed = rows[is_error(rows["status"])]
        self.errors += list(zip(failed["id"], failed["status"]))
        if len(self.errors) > self.max_share * self.total:
            first = "; ".join(f"{i}: {s.removeprefix(ERROR)}" for i, s in self.errors[:3])
            raise FailedRecordsError(
                f"{len(self.errors)} of {self.total} records failed, more than {self.key} = {self.max_share} allows; "
                f"first errors: {first}. Finished records are kept in {self.dir}: fix the cause and rerun, "
                "which computes only the failed and missing records"
            )


ENTRY = ".manifest.json"  # shard-NNNNN.manifest.json: the shard's manifest entry


class ShardStore:
    """Shards ``shard-NNNNN.parquet`` of a table processed ``size`` rows at a time, under one configuration."""

    def __init__(self, directory: str | Path, config: dict[str, Any]):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_hash = digest = config_hash(config)
        manifest = self.dir / "manifest.json"
        try:
            previous = json.loads(manifest.read_text()) if manifest.exists() else {}
        except (OSError, ValueError) as err:  # each shard's entry names its key: the finished ones are kept
            log.warning(
                "%s cannot be read (%s): written again; the shard entries say which shards are finished", manifest, err
            )
            write_json(manifest, {"config_hash": digest, "config": config})
            previous = {"config_hash": digest}
        if previous.get("config_hash") != digest:
            stale = list(self.dir.glob("shard-*"))
            if stale:
                old = previous.get("config", {})
                changed = sorted(k for k in config.keys() | old.keys() if config.get(k) != old.get(k))
                log.info(
                    "%s: %s changed since the shards were written: %d stale files removed",
                    self.dir,
                    changed,
                    len(stale),
                )
            for path in stale:
                path.unlink()
            write_json(manifest, {"config_hash": digest, "config": config})

    def path(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.parquet"

    def sidecar(self, index: int, suffix: str) -> Path:
        """A file that belongs to shard ``index``; write it before the shard (whose entry then records it too)."""
        return self.dir / f"shard-{index:05d}{suffix}"

    def entry(self, index: int) -> Path:
        """Shard ``index``'s manifest entry: the sha256 of its files and the key's hash, written after them."""
        return self.sidecar(index, ENTRY)

    def _seal(self, index: int) -> None:
        """Write shard ``index``'s entry: its parquet and every sidecar (``shard-NNNNN.*``) as they are now."""
        prefix = self.path(index).stem
        names = sorted(p.name for p in self.dir.glob(f"{prefix}.*") if p != self.entry(index))
        write_json(self.entry(index), {"config_hash": self.config_hash, "files": file_digests(self.dir, names)})

    def problem(self, index: int) -> str | None:
        """Why shard ``index`` is not finished though it is on disk (its entry missing, unreadable or of another key, a
        file missing, unreadable or not what was written); None when it is finished, or when nothing of it was
        written."""
        entry = self.entry(index)
        try:
            recorded = json.loads(entry.read_text())
            files = recorded["files"]
        except FileNotFoundError:
            return (
                f"{self.path(index)} has no manifest entry (killed before it was written?)"
                if self.path(index).exists()
                else None
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"its manifest entry {entry} cannot be read ({type(err).__name__}: {err})"
        if recorded.get("config_hash") != self.config_hash:
            return f"its manifest entry {entry} was written under another key"
        if self.path(index).name not in files:
            return f"its manifest entry {entry} lists no {self.path(index).name}"
        return changed_file(self.dir, files)

    def done(self, index: int) -> bool:
        """Whether shard ``index`` is finished: written, with its entry, and its files are what was written."""
        return self.entry(index).exists() and self.problem(index) is None

    def write_arrays(self, index: int, suffix: str, arrays: dict[str, np.ndarray]) -> None:
        """Per-record arrays of shard ``index`` (by record id, e.g. hidden states of generated tokens) in its sidecar
        ``suffix`` (written atomically): write them before the shard. A retry of a finished shard's errors adds to what
        its finished records stored, and its entry records the new sidecar."""
        sidecar = self.sidecar(index, suffix)
        finished = self.done(index)
        kept = load_file(str(sidecar)) if finished and sidecar.exists() else {}
        tmp = sidecar.with_name(f".{sidecar.name}.part")
        save_file(kept | arrays, str(tmp))
        os.replace(tmp, sidecar)
        if finished:
            self._seal(index)

    def read_with_arrays(self, n_items: int, size: int, suffix: str, column: str) -> tuple[pd.DataFrame, np.ndarray]:
        """Every shard in order (as :meth:`read_all`) and the arrays of its ok records (:meth:`write_arrays`) stacked
        into one: ``column`` holds each record's first row in it (-1 for a record without arrays)."""
        frames, blocks, offset = [], [], 0
        for k in range(self.count(n_items, size)):
            shard = self.read(range(k, k + 1))
            sidecar = self.sidecar(k, suffix)
            arrays = load_file(str(sidecar)) if sidecar.exists() else {}
            offsets = []
            for row in shard.itertuples():
                stored = row.status == OK and row.id in arrays
                offsets.append(offset if stored else -1)
                if stored:
                    blocks.append(arrays[row.id])
                    offset += len(arrays[row.id])
            frames.append(shard.assign(**{column: offsets}))
        width = blocks[0].shape[1] if blocks else 0
        return pd.concat(frames, ignore_index=True), np.concatenate(blocks) if blocks else np.zeros(
            (0, width), np.float16
        )

    def write(self, index: int, frame: pd.DataFrame) -> None:
        """Write shard ``index``; when it exists already (a retry of its errors), ``frame``'s records
        replace those with the same ids and the others are kept, in their order."""
        if self.done(index):
            old = self.read(range(index, index + 1))
            merged = pd.concat([old[~old["id"].isin(frame["id"])], frame], ignore_index=True)
            frame = merged.set_index("id").loc[old["id"]].reset_index()
        tmp = self.dir / f".shard-{index:05d}.parquet.part"
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, self.path(index))
        self._seal(index)

    def read(self, indices: range) -> pd.DataFrame:
        frames = [pd.read_parquet(self.path(i)) for i in indices]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    @staticmethod
    def count(n_items: int, size: int) -> int:
        return (n_items + size - 1) // size

    def _todo(self, index: int, chunk: pd.DataFrame) -> pd.DataFrame:
        """The rows of shard ``index`` to compute: all of an unfinished shard (logged by name when it is on disk), the
        errors of a finished one."""
        problem = self.problem(index)
        if problem is not None:
            log.warning("%s: shard %d is not finished, computing it again: %s", self.dir, index, problem)
        if problem is not None or not self.entry(index).exists():
            return chunk
        stored = pd.read_parquet(self.path(index), columns=["id", "status"])
        return chunk[chunk["id"].isin(stored.loc[is_error(stored["status"]), "id"])]

    def todo(self, table: pd.DataFrame, size: int) -> list[tuple[int, pd.DataFrame]]:
        """The work left in ``table`` (which has an ``id`` column) as ``(shard index, rows)``: every row of an
        unfinished shard and the error records of a finished one."""
        chunks = [
            (k, self._todo(k, table.iloc[k * size : (k + 1) * size])) for k in range(self.count(len(table), size))
        ]
        return [(k, rows) for k, rows in chunks if len(rows)]

    def read_all(self, n_items: int, size: int) -> pd.DataFrame:
        """Every shard of a table of ``n_items`` rows, in order (all must be done)."""
        return self.read(range(self.count(n_items, size)))


def run_shards(
    store: ShardStore,
    table: pd.DataFrame,
    size: int,
    make_worker: Callable[[], Callable[[tuple[int, pd.DataFrame]], pd.DataFrame]],
    execution: ExecutionParams,
    budget: FailureBudget,
    desc: str,
    unit: str,
) -> None:
    """Compute the work left in ``table`` in shards of ``size`` rows, where ``execution`` says (see
    :mod:`detectors.execution`), with a progress bar over the records. ``make_worker()`` builds a worker (it loads
    the LLM once); ``worker((k, rows))`` computes those rows of shard ``k``, writes the shard with ``store.write``
    and returns the records' ``id`` and ``status``, which the failure budget counts. A worker that stops halfway
    loses only its shard in flight: the others are on disk, and the next run computes only what is missing."""
    todo = store.todo(table, size)
    n_todo = sum(len(rows) for _, rows in todo)
    log.info(
        "%s: %d %s in %d shards, %d %s to compute", desc, len(table), unit, store.count(len(table), size), n_todo, unit
    )
    with progress(total=len(table), initial=len(table) - n_todo, desc=desc, unit=unit) as bar:
        for i, statuses in map_units(todo, make_worker, execution):
            k, rows = todo[i]
            if not store.done(k):
                raise RuntimeError(f"the worker of shard {k} of {store.dir} returned without writing it")
            budget.add(statuses)
            bar.update(len(rows))
