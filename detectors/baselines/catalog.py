"""Every training-free scorer of the comparison: :func:`question_baselines` and :func:`realtime_baselines` return each
one whose input is available, so a comparison lists a baseline exactly when its scores were computed. The fixed
scorers are lazy-registry entries (:mod:`detectors.lazy`, as every extension point); the logistic probe and CtrlA's
scorers (one per score column the stages wrote) are made from the columns."""

from __future__ import annotations

from detectors.baselines.ctrla_confidence import question_scorers as ctrla_question_scorers
from detectors.baselines.ctrla_confidence import realtime_scorers as ctrla_realtime_scorers
from detectors.baselines.logreg import LogisticScorer
from detectors.evaluation.scorers import ColumnScorer, TokenStatScorer
from detectors.interfaces import Level, Scorer
from detectors.lazy import LazyRegistry

# question-level scorer of an early-set column (or of the score tables joined to it) -> the scorer
QUESTION_BASELINES = LazyRegistry(
    "question-level baseline",
    {
        "attribution_entropy": "detectors.baselines.attribution_entropy:ATTRIBUTION_ENTROPY",
        "first_token_prob": "detectors.baselines.first_token:FIRST_TOKEN_PROB",
        "first_token_entropy": "detectors.baselines.first_token:FIRST_TOKEN_ENTROPY",
        "retrorag_self_consistency": "detectors.baselines.retrorag:RETRORAG_SELF_CONSISTENCY",
        "retrorag_self_evaluation": "detectors.baselines.retrorag:RETRORAG_SELF_EVALUATION",
    },
)
# scorer of a per-token statistic of the real-time set -> its class (one instance per level it defines)
REALTIME_BASELINES = LazyRegistry(
    "per-token baseline",
    {
        "flare": "detectors.baselines.flare:Flare",
        "sit_min": "detectors.baselines.stitch_in_time:SitMin",
        "sit_avg": "detectors.baselines.stitch_in_time:SitAvg",
        "sit_norm": "detectors.baselines.stitch_in_time:SitNorm",
        "token_entropy": "detectors.baselines.token_entropy:TokenEntropy",
        "rind": "detectors.baselines.rind:Rind",
    },
)


def question_baselines(columns: set[str]) -> list[Scorer]:
    """Every training-free question-level scorer whose input columns are among ``columns`` (the early set
    joined with the score tables), CtrlA's one per ``ctrla_confidence*`` column."""
    probe = LogisticScorer()
    scorers: list[Scorer] = [probe] if set(probe.columns) <= columns else []
    column_scorers: list[ColumnScorer] = [QUESTION_BASELINES.load(name) for name in QUESTION_BASELINES]
    scorers += [s for s in column_scorers if s.column in columns]
    return scorers + ctrla_question_scorers(columns)


def realtime_baselines(level: Level, stats: set[str]) -> list[Scorer]:
    """Every training-free scorer defined at ``level`` (token, entity or continuation) whose per-token
    statistic is among ``stats``, CtrlA's one per ``ctrla_confidence*`` stat."""
    classes: list[type[TokenStatScorer]] = [REALTIME_BASELINES.load(name) for name in REALTIME_BASELINES]
    scorers: list[Scorer] = [cls(level) for cls in classes if level in cls.levels and cls.stat in stats]
    return scorers + ctrla_realtime_scorers(level, stats)
