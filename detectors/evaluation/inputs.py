"""What the comparison reads besides the data sets: other stages' per-id score tables, joined generically (a missing
table means that scorer is absent). The trained detectors are loaded by the stage (``pipelines.evaluate``): evaluation
imports no detector package, they import it."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

log = logging.getLogger(__name__)


def join_score_tables(frame: pd.DataFrame, tables: dict[str, str | Path]) -> tuple[pd.DataFrame, list[str]]:
    """``frame`` left-joined by ``id`` with every existing table of ``tables`` (``{what: path}``), and the joined
    columns. A missing table is logged and skipped: its scorers are absent from the comparison."""
    joined: list[str] = []
    for what, path in tables.items():
        path = Path(path)
        if not path.exists():
            log.info("no %s scores at %s: the comparison goes on without them", what, path)
            continue
        table = pd.read_parquet(path)
        if "id" not in table:
            columns = list(table.columns)
            raise ValueError(
                f"{what} scores at {path} have no 'id' column (columns: {columns}); rerun the stage that writes it"
            )
        columns = [c for c in table.columns if c != "id"]
        clash = sorted(set(columns) & (set(frame.columns) | set(joined)))
        if clash:
            raise ValueError(
                f"{what} scores at {path} repeat columns {clash} that the data set or another score table has; "
                f"rename them"
            )
        frame = frame.merge(table, on="id", how="left")
        joined += columns
    return frame, joined
