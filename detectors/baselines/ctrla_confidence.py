"""CtrlA's confidence monitor (Eq. 2) as a hallucination score, read from the scores evaluate_directions
wrote: per answer ``-min`` Eq. 2 over its new non-stopword tokens (question level), per generated token
``-`` Eq. 2 (token level; entities and continuations take the max). A score table may hold several
variants (``ctrla_confidence`` and columns named ``ctrla_confidence<suffix>``, e.g. other layer ranges):
each is its own scorer, named after its column."""

from __future__ import annotations

import dataclasses

from detectors.ctrla import SCORE_COLUMN as NAME
from detectors.evaluation.scorers import ColumnScorer, TokenStatScorer
from detectors.interfaces import Level

CTRLA_CONFIDENCE = ColumnScorer(NAME, NAME)


@dataclasses.dataclass(frozen=True)
class CtrlAConfidence(TokenStatScorer):
    name: str = NAME
    stat: str = NAME


def ctrla_question_scorers(columns: set[str]) -> list[ColumnScorer]:
    """One question-level scorer per ``ctrla_confidence*`` column, in name order."""
    return [ColumnScorer(c, c) for c in sorted(columns) if c.startswith(NAME)]


def ctrla_realtime_scorers(level: Level, stats: set[str]) -> list[CtrlAConfidence]:
    """One scorer at ``level`` per ``ctrla_confidence*`` per-token stat, in name order."""
    return [CtrlAConfidence(level, name=s, stat=s) for s in sorted(stats) if s.startswith(NAME)]
