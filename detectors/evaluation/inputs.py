"""What the comparison reads besides the data sets: other stages' per-id score tables, joined generically
(a missing table means that scorer is absent), and the trained early detectors, one per directory."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from detectors.dior.early_detector import load_early_detectors
from detectors.evaluation.scorers import DetectorScorer

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
                f"{what} scores at {path} repeat columns {clash} that the data set or another score table has; rename them"
            )
        frame = frame.merge(table, on="id", how="left")
        joined += columns
    return frame, joined


def early_detector_scorers(model_dir: str | Path) -> list[DetectorScorer]:
    """Every trained early detector under ``model_dir`` (``dior-early``, ``dior-early-extended``, ablations), a scorer
    named after its directory."""
    return [DetectorScorer(name, detector) for name, detector in load_early_detectors(model_dir).items()]
