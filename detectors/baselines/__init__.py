"""Training-free hallucination scores, one small module each, behind :class:`detectors.interfaces.Scorer`.

Question level: attribution entropy (DioR Eq. 1), first-token probability and entropy, a logistic-
regression probe; real-time levels: FLARE, Stitch-in-Time MIN/AVG/NORM, token entropy; both: CtrlA's
confidence monitor.
"""

from __future__ import annotations

from detectors.baselines.attribution_entropy import ATTRIBUTION_ENTROPY
from detectors.baselines.ctrla_confidence import CTRLA_CONFIDENCE, CtrlAConfidence
from detectors.baselines.first_token import FIRST_TOKEN_ENTROPY, FIRST_TOKEN_PROB
from detectors.baselines.flare import Flare
from detectors.baselines.logreg import LogisticScorer
from detectors.baselines.stitch_in_time import SitAvg, SitMin, SitNorm
from detectors.baselines.token_entropy import TokenEntropy
from detectors.evaluation.scorers import ColumnScorer, TokenStatScorer
from detectors.interfaces import Level, Scorer

REALTIME_BASELINES: tuple[type[TokenStatScorer], ...] = (Flare, SitMin, SitAvg, SitNorm, TokenEntropy)


def question_baselines(columns: set[str]) -> list[Scorer]:
    """Every training-free question-level scorer whose input column is in ``columns`` (the early set joined with
    the other stages' per-id score tables): CtrlA gives one scorer per ``ctrla_confidence*`` column."""
    fixed: list[Scorer] = [LogisticScorer(), ATTRIBUTION_ENTROPY, FIRST_TOKEN_PROB, FIRST_TOKEN_ENTROPY]
    ctrla = [ColumnScorer(c, c) for c in sorted(columns) if c.startswith(CTRLA_CONFIDENCE.column)]
    return [s for s in fixed if s.features in columns or isinstance(s, LogisticScorer)] + ctrla


def realtime_baselines(level: Level, stats: set[str]) -> list[Scorer]:
    """Every training-free scorer defined at ``level`` (token, entity or continuation) whose per-token statistic
    is in ``stats``: CtrlA gives one scorer per ``ctrla_confidence*`` statistic."""
    scorers = [cls(level) for cls in REALTIME_BASELINES if level in cls.levels]
    ctrla = [CtrlAConfidence(level, name=s, stat=s) for s in sorted(stats) if s.startswith(CtrlAConfidence.stat)]
    return [s for s in scorers if s.stat in stats] + [s for s in ctrla if level in s.levels]
