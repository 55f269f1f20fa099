"""CtrlA's confidence monitor (Eq. 2) as a hallucination score, read from the scores evaluate_directions
wrote: per answer ``-min`` Eq. 2 over its new non-stopword tokens (question level), per generated token
``-`` Eq. 2 (token level; entities and continuations take the max)."""

from __future__ import annotations

import dataclasses

from detectors.ctrla import SCORE_COLUMN as NAME
from detectors.evaluation.scorers import ColumnScorer, TokenStatScorer

CTRLA_CONFIDENCE = ColumnScorer(NAME, NAME)


@dataclasses.dataclass(frozen=True)
class CtrlAConfidence(TokenStatScorer):
    name: str = NAME
    stat: str = NAME
