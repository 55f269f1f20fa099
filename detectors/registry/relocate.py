"""A sqlite MLflow store that can be moved or cloned with its project: detected when read, relocated when asked.

MLflow's sqlite store keeps every artifact location absolute (``resolve_uri_if_local`` makes a relative
experiment location absolute when the experiment is created, and runs, logged models and model versions copy
it), so a store copied to another directory would read, and write, the artifacts of the original. The store
directory (the one holding the ``.db`` file, ``data/mlflow`` here; the artifact root lives under it) is therefore
recorded in the store itself, as the tag :data:`ANCHOR_TAG` of MLflow's ``Default`` experiment, by the first stage
that creates an experiment there (:func:`anchor`).

- Reading never writes: :func:`require_sound` refuses a database file that is empty, malformed or holds no MLflow
  store (MLflow would write a new schema into an empty file, or fail with a long traceback), reading it read-only;
  :func:`require_in_place` compares the recorded directory with the one the database is in
  now and raises :class:`StoreMovedError` (one line: run the relocate command) when they differ.
- :func:`relocate` (``dynrag relocate``) rewrites every location under the recorded directory to the same path under
  the current one and records the new directory. Locations outside the store directory are left as they are (they
  did not move with it).

MLflow has an API for the tag (``MlflowClient.get_experiment`` / ``set_experiment_tag``) but none that changes an
artifact location, so the locations are rewritten through MLflow's own table definitions (its SQLAlchemy models,
:data:`LOCATIONS`), in one transaction: a column MLflow renames fails loudly at import instead of being skipped.
``tests/test_registry.py`` checks against the pinned MLflow (3.17) that no value in a relocated store still names the
old directory, so a location column MLflow adds is caught there.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from detectors.errors import InputError

ANCHOR_TAG = "detectors.store_dir"
DEFAULT_EXPERIMENT = "0"
RELOCATE_COMMAND = "dynrag relocate --tracking-uri {uri}"


class StoreMovedError(InputError):
    """A sqlite store opened from another directory than the one it records: its artifact locations point to the old
    one."""


class StoreDamagedError(InputError):
    """A sqlite store's database file is empty, malformed (truncated, corrupted) or holds no MLflow store."""


class StoreRelocationError(InputError):
    """A moved store could not be relocated (e.g. it is read-only)."""


def sqlite_path(uri: str) -> Path | None:
    """The database file of an absolute ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :].split("?", 1)[0]).resolve()


SQLITE_HEADER = b"SQLite format 3\x00"
RESTORE = (
    "restore it from a backup, or move it aside and register the detectors again in a new one (`dvc repro -f -s "
    "register`, `dvc repro -f -s register_ctrla`; evaluate, evaluate_directions and rag_eval log their runs there too)"
)


def require_sound(db: Path) -> None:
    """Raise :class:`StoreDamagedError` naming ``db`` unless it is a sqlite database that passes sqlite's quick check
    and holds MLflow's tables. Opened read-only: checking never writes, and an empty file is refused, not
    initialised."""
    if db.stat().st_size == 0:
        raise StoreDamagedError(
            f"the MLflow store {db} is an empty file (0 bytes), not a store (it is left as it is: reading never "
            f"writes): {RESTORE}"
        )
    with open(db, "rb") as f:
        if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            raise StoreDamagedError(f"the MLflow store {db} is not a sqlite database (no sqlite header): {RESTORE}")
    try:
        with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True, timeout=30)) as con:
            found = [row[0] for row in con.execute("PRAGMA quick_check")]
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.OperationalError:  # locked, or not readable: not the file's fault, sqlite's message says what
        raise
    except sqlite3.DatabaseError as err:
        found, tables = [str(err)], set()
    if found != ["ok"]:
        raise StoreDamagedError(
            f"the MLflow store {db} is malformed (sqlite: {'; '.join(found[:3])}), e.g. truncated: {RESTORE}"
        )
    if not {"alembic_version", "experiments"} <= tables:
        raise StoreDamagedError(
            f"{db} is a sqlite database but holds no MLflow store (no MLflow tables): check the tracking URI"
        )


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def recorded_dir(uri: str) -> str | None:
    """The directory the sqlite store at ``uri`` records as its own (read through MLflow, never written); None when it
    records none (a store written before stores were anchored, or one no stage has created an experiment in yet) or when
    the database does not exist yet."""
    from mlflow.exceptions import MlflowException

    db = sqlite_path(uri)
    if db is None or not db.exists() or db.stat().st_size == 0:
        return None
    try:
        return _client(uri).get_experiment(DEFAULT_EXPERIMENT).tags.get(ANCHOR_TAG)
    except MlflowException as err:  # no Default experiment (a person deleted it): nothing recorded
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def require_in_place(uri: str) -> None:
    """Raise :class:`StoreMovedError` when the sqlite store at ``uri`` records another directory than its own."""
    db = sqlite_path(uri)
    recorded = recorded_dir(uri)
    if db is not None and recorded is not None and recorded != str(db.parent):
        raise StoreMovedError(
            f"the MLflow store {db} was moved from {recorded} (its artifact locations still point there): run "
            f"`{RELOCATE_COMMAND.format(uri=f'sqlite:///{db}')}` once, with write access, to rewrite them"
        )


def anchor(uri: str) -> None:
    """Record the sqlite store's directory in it when it records none (a writer's first experiment); other stores:
    nothing."""
    db = sqlite_path(uri)
    if db is not None and db.exists() and recorded_dir(uri) is None:
        _client(uri).set_experiment_tag(DEFAULT_EXPERIMENT, ANCHOR_TAG, str(db.parent))


def _locations():
    """Every column of MLflow's schema that holds an artifact location, as (its SQLAlchemy model, attribute)."""
    from mlflow.store.model_registry.dbmodels.models import SqlModelVersion
    from mlflow.store.tracking.dbmodels.models import SqlExperiment, SqlLoggedModel, SqlRun

    return (
        (SqlExperiment, "artifact_location"),
        (SqlRun, "artifact_uri"),
        (SqlLoggedModel, "artifact_location"),
        (SqlModelVersion, "source"),
        (SqlModelVersion, "storage_location"),
    )


def _rewrite(uri: str, old: str, new: str) -> int:
    """Replace the prefix ``old`` of every location (a plain path or a ``file://`` URI) with ``new``, in one
    transaction; returns how many values changed."""
    from mlflow.store.db.utils import create_sqlalchemy_engine
    from sqlalchemy import func, literal, or_, update
    from sqlalchemy.orm import Session

    changed = 0
    engine = create_sqlalchemy_engine(uri)
    try:
        with Session(engine) as session, session.begin():
            for model, attr in _locations():
                column = getattr(model, attr)
                for a, b in ((old, new), (Path(old).as_uri(), Path(new).as_uri())):
                    statement = (
                        update(model)
                        .where(or_(column == a, column.startswith(a + "/", autoescape=True)))
                        .values({attr: literal(b) + func.substr(column, len(a) + 1)})
                        .execution_options(synchronize_session=False)
                    )
                    changed += session.execute(statement).rowcount
    finally:
        engine.dispose()
    return changed


def relocate(uri: str, old: str | Path | None = None) -> dict:
    """Anchor the sqlite store at ``uri`` at its current directory, rewriting the artifact locations under the directory
    it moved from (``old`` when given, e.g. for a store that records none; else the one it records): ``{"store", "from",
    "to", "rewritten"}``.

    A store already in place is left alone; one that records no directory and gets no ``old`` is anchored where it
    is."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    db = sqlite_path(uri)
    if db is None:
        raise StoreRelocationError(
            f"{uri} is not a sqlite store: only a sqlite store moves with its project (a server's stays where it is)"
        )
    if not db.exists():
        raise StoreRelocationError(
            f"no MLflow store at {db}: check the tracking URI (a relative sqlite path is relative to the project root)"
        )
    require_sound(db)
    here = str(db.parent)
    source = str(Path(old).resolve()) if old is not None else recorded_dir(uri)
    result = {"store": str(db), "from": source, "to": here, "rewritten": 0}
    try:
        if source is not None and source != here:
            result["rewritten"] = _rewrite(uri, source, here)
        if recorded_dir(uri) != here:
            _client(uri).set_experiment_tag(DEFAULT_EXPERIMENT, ANCHOR_TAG, here)
    except (SQLAlchemyError, MlflowException) as err:
        reason = str(err).splitlines()[0]
        raise StoreRelocationError(
            f"cannot relocate the MLflow store {db} to {here} ({reason}): relocating writes to it, so run it with "
            f"write access"
        ) from err
    return result
