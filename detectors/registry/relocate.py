"""A sqlite MLflow store that can be moved or cloned with its project.

MLflow's sqlite store keeps every artifact location absolute (``resolve_uri_if_local`` makes a relative
experiment location absolute when the experiment is created, and runs, logged models and model versions copy
it), so a store copied to another directory would read, and write, the artifacts of the original. The store
directory (the one holding the ``.db`` file, ``data/mlflow`` here; the artifact root lives under it) is
recorded in the store itself, as the tag :data:`ANCHOR_TAG` of MLflow's ``Default`` experiment. When the
store is opened from another directory, :func:`relocate` rewrites every location under the recorded
directory to the same path under the current one, in one transaction, and records the new directory.
Locations outside the store directory are left as they are (they did not move with it).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

ANCHOR_TAG = "detectors.store_dir"
DEFAULT_EXPERIMENT = 0
LOCATIONS = (  # every column of MLflow 3's schema that holds an artifact location
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


class StoreRelocationError(RuntimeError):
    """A moved store could not be re-anchored (e.g. it is read-only)."""


def sqlite_path(uri: str) -> Path | None:
    """The database file of an absolute ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :].split("?", 1)[0]).resolve()


def _rewrite(con: sqlite3.Connection, tables: set[str], old: str, new: str) -> int:
    """Replace the prefix ``old`` of every location (plain path or ``file://`` URI) with ``new`` in ``tables``."""
    changed = 0
    for table, column in LOCATIONS:
        if table not in tables:
            continue
        for a, b in ((old, new), (Path(old).as_uri(), Path(new).as_uri())):
            changed += con.execute(
                f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE {column} = ? OR substr({column}, 1, ?) = ?",
                (b, len(a) + 1, a, len(a) + 1, a + "/"),
            ).rowcount
    return changed


def relocate(db: str | Path) -> str | None:
    """Anchor the store ``db`` at its current directory; returns the directory it moved from, if it had moved.

    A store without a recorded directory (new, or written before this existed) is anchored where it is.
    A database without MLflow's tables yet is left alone (MLflow creates them on first use).
    """
    db = Path(db).resolve()
    if not db.exists():
        return None
    here = str(db.parent)
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as con, con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"experiments", "experiment_tags"} <= tables:
                return None
            row = con.execute(
                "SELECT value FROM experiment_tags WHERE experiment_id = ? AND key = ?", (DEFAULT_EXPERIMENT, ANCHOR_TAG)
            ).fetchone()
            if row is not None and row[0] == here:
                return None
            if row is not None:
                _rewrite(con, tables, row[0], here)
            con.execute(
                "INSERT OR REPLACE INTO experiment_tags (key, value, experiment_id) VALUES (?, ?, ?)",
                (ANCHOR_TAG, here, DEFAULT_EXPERIMENT),
            )
    except sqlite3.Error as err:
        raise StoreRelocationError(
            f"cannot anchor the MLflow store {db} at {here} ({err}): a moved or new store records its directory once, "
            "so open it once with write access (any stage, or load_detector, does it)"
        ) from err
    return None if row is None else row[0]
