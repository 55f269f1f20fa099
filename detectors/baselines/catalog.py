"""Every training-free scorer of the comparison: :func:`question_baselines` and :func:`realtime_baselines` return each
one
whose input is available, so a comparison lists a baseline exactly when its scores were computed."""

from __future__ import annotations

from detectors.baselines.attribution_entropy import ATTRIBUTION_ENTROPY
from detectors.baselines.ctrla_confidence import (
    question_scorers as ctrla_question_scorers,
)
from detectors.baselines.ctrla_confidence import (
    realtime_scorers as ctrla_realtime_scorers,
)
from detectors.baselines.first_token import FIRST_TOKEN_ENTROPY, FIRST_TOKEN_PROB
from detectors.baselines.flare import Flare
from detectors.baselines.logreg import LogisticScorer
from detectors.baselines.retrorag import RETRORAG_SELF_CONSISTENCY, RETRORAG_SELF_EVALUATION
from detectors.baselines.rind import Rind
from detectors.baselines.stitch_in_time import SitAvg, SitMin, SitNorm
from detectors.baselines.token_entropy import TokenEntropy
from detectors.evaluation.scorers import ColumnScorer, TokenStatScorer
from detectors.interfaces import Level, Scorer

QUESTION_BASELINES: tuple[ColumnScorer, ...] = (
    ATTRIBUTION_ENTROPY,
    FIRST_TOKEN_PROB,
    FIRST_TOKEN_ENTROPY,
    RETRORAG_SELF_CONSISTENCY,
    RETRORAG_SELF_EVALUATION,
)
REALTIME_BASELINES: tuple[type[TokenStatScorer], ...] = (Flare, SitMin, SitAvg, SitNorm, TokenEntropy, Rind)


def question_baselines(columns: set[str]) -> list[Scorer]:
    """Every training-free question-level scorer whose input columns are among ``columns`` (the early set
    joined with the score tables), CtrlA's one per ``ctrla_confidence*`` column."""
    probe = LogisticScorer()
    scorers: list[Scorer] = [probe] if set(probe.columns) <= columns else []
    scorers += [s for s in QUESTION_BASELINES if s.column in columns]
    return scorers + ctrla_question_scorers(columns)


def realtime_baselines(level: Level, stats: set[str]) -> list[Scorer]:
    """Every training-free scorer defined at ``level`` (token, entity or continuation) whose per-token
    statistic is among ``stats``, CtrlA's one per ``ctrla_confidence*`` stat."""
    scorers: list[Scorer] = [cls(level) for cls in REALTIME_BASELINES if level in cls.levels and cls.stat in stats]
    return scorers + ctrla_realtime_scorers(level, stats)
