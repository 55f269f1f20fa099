"""CtrlA's confidence monitor (Eq. 2) as a hallucination score, read from the scores evaluate_directions
wrote: per answer ``-min`` Eq. 2 over its new non-stopword tokens (question level), per generated token
``-`` Eq. 2 (token level; entities and continuations take the max). One scorer per score column (every
column whose name starts with ``ctrla_confidence``: the paper's layer range, the range chosen on validation)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from detectors.ctrla import SCORE_COLUMN as NAME
from detectors.evaluation.scorers import ColumnScorer, TokenStatScorer
from detectors.interfaces import Level

CTRLA_CONFIDENCE = ColumnScorer(NAME, NAME)


@dataclasses.dataclass(frozen=True)
class CtrlAConfidence(TokenStatScorer):
    name: str = NAME
    stat: str = NAME


def is_ctrla_column(name: str) -> bool:
    """Whether a score column (or per-token stat) holds CtrlA confidence scores of some layer range."""
    return name.startswith(NAME)


def question_scorers(columns: Iterable[str]) -> list[ColumnScorer]:
    """One question-level scorer per CtrlA score column among ``columns`` (named after the column)."""
    return [ColumnScorer(c, c) for c in sorted(set(columns)) if is_ctrla_column(c)]


def realtime_scorers(level: Level, stats: Iterable[str]) -> list[CtrlAConfidence]:
    """One scorer at ``level`` per CtrlA per-token stat among ``stats`` (named after the stat)."""
    return [CtrlAConfidence(level, name=s, stat=s) for s in sorted(set(stats)) if is_ctrla_column(s)]
