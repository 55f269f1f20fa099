"""Stable ids, splits and samples by id hash: the same record lands in the same split on every machine."""

from __future__ import annotations

import hashlib
from pathlib import PurePath

import pandas as pd

REMOTE_PREFIXES = ("bigbench:", "hf:")


def source_key(source: str) -> str:
    """What identifies a source in record ids: ``bigbench:<task>`` / ``hf:<id>`` as given, a file by its name only, so
    that the same file gives the same ids (hence the same splits and samples) wherever the project sits."""
    return source if source.startswith(REMOTE_PREFIXES) else PurePath(source).name


def stable_id(question: str, source: str) -> str:
    """A record id from its text and its source (see :func:`source_key`)."""
    return hashlib.sha1(f"{source_key(source)}\x1f{question.strip()}".encode()).hexdigest()[:16]


def split_of(record_id: str, ratios: dict[str, float]) -> str:
    """Deterministic split from the id's hash: the same id lands in the same split on every machine."""
    u = int(hashlib.sha256(record_id.encode()).hexdigest()[:12], 16) / float(16**12)
    edge = 0.0
    for name in ("train", "val", "test"):
        edge += ratios[name]
        if u < edge:
            return name
    return "test"


def ok_records(frame: pd.DataFrame, split: str | None) -> pd.DataFrame:
    """The records of ``split`` (None: every split) a trainer and its evaluation use: those built without error
    (``status`` ok). The one definition of a split's usable records: the early detector trains and validates on it,
    the real-time detector's served AUROC and its validation digest read it, and the register stage's digest of the
    early detectors' validation records is computed from it, so that they always name the same records."""
    ok = frame[frame["status"] == "ok"]
    return ok if split is None else ok[ok["split"] == split]


def sample(df: pd.DataFrame, limit: int | None) -> pd.DataFrame:
    """A deterministic subset of ``limit`` records (by id hash), independent of the source's order."""
    if limit is None or limit >= len(df):
        return df
    keys = df["id"].map(lambda i: hashlib.sha256(f"sample\x1f{i}".encode()).hexdigest())
    return df.loc[keys.sort_values().index[:limit]].sort_index().reset_index(drop=True)


def in_fold(record_id: str, share: float, salt: str) -> bool:
    """Whether record ``record_id`` falls in a ``share`` of its split named by ``salt``, by id hash (independent of the
    split's own hash, so the same records on every machine)."""
    u = int(hashlib.sha256(f"{salt}\x1f{record_id}".encode()).hexdigest()[:12], 16) / float(16**12)
    return u < share
