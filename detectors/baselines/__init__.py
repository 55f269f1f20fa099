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
from detectors.evaluation.scorers import TokenStatScorer
from detectors.interfaces import Level, Scorer

REALTIME_BASELINES: tuple[type[TokenStatScorer], ...] = (Flare, SitMin, SitAvg, SitNorm, TokenEntropy)


def question_baselines(with_ctrla: bool = False) -> list[Scorer]:
    """Every training-free question-level scorer (CtrlA's when its scores were joined in)."""
    return [LogisticScorer(), ATTRIBUTION_ENTROPY, FIRST_TOKEN_PROB, FIRST_TOKEN_ENTROPY] + ([CTRLA_CONFIDENCE] if with_ctrla else [])


def realtime_baselines(level: Level, with_ctrla: bool = False) -> list[Scorer]:
    """Every training-free scorer defined at ``level`` (token, entity or continuation)."""
    classes = REALTIME_BASELINES + ((CtrlAConfidence,) if with_ctrla else ())
    return [cls(level) for cls in classes if level in cls.levels]
