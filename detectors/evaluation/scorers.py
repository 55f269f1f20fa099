"""Scorer building blocks (the interface is :class:`detectors.interfaces.Scorer`): a stored column, a trained
detector, and scores computed from per-token statistics at the token, entity or continuation level."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from detectors.interfaces import Level


@dataclasses.dataclass(frozen=True)
class ColumnScorer:
    """A training-free score read from one stored feature column, negated when low means hallucinated."""

    name: str
    column: str
    higher_is_hallucinated: bool = True
    level: Level = Level.QUESTION
    kind: str = "baseline"
    is_probability: bool = False
    threshold: float | None = None  # None: chosen on validation by the evaluation

    @property
    def features(self) -> str:
        return self.column

    def score(self, units: pd.DataFrame) -> np.ndarray:
        values = units[self.column].to_numpy(dtype=np.float64)
        return values if self.higher_is_hallucinated else -values


@dataclasses.dataclass
class DetectorScorer:
    """A trained question-level detector scoring stored feature rows, with its own threshold; ``seeds``: one scorer
    per seed of its seed ensemble (the comparison reports their spread)."""

    name: str
    detector: Any  # anything with predict_proba(frame), threshold and groups (EarlyDetector)
    level: Level = Level.QUESTION
    kind: str = "detector"
    is_probability: bool = True
    seeds: list[DetectorScorer] = dataclasses.field(default_factory=list)

    @classmethod
    def with_seeds(cls, name: str, detector: Any) -> DetectorScorer:
        """The detector's scorer with one scorer per seed (``detector.per_seed()``: none for a single net)."""
        seeds = detector.info.get("seeds", [])
        members = [cls(f"{name}[seed {s}]", d) for s, d in zip(seeds, detector.per_seed())]
        return cls(name, detector, seeds=members)

    @property
    def features(self) -> str:
        return ",".join(self.detector.groups)

    @property
    def threshold(self) -> float:
        return self.detector.threshold

    def score(self, units: pd.DataFrame) -> np.ndarray:
        return self.detector.predict_proba(units)


@dataclasses.dataclass(frozen=True)
class TokenStatScorer:
    """A score from one per-token statistic (``stat``) at the token, entity or continuation level.

    Subclasses say how a token scores (:meth:`token`) and how an entity's tokens combine (:meth:`entity`);
    a continuation scores its most suspicious entity unless :meth:`continuation` says otherwise.
    ``levels`` lists where the score is defined. A unit whose record lacks ``stat`` scores NaN.
    """

    level: Level
    name: str = ""
    stat: str = ""
    levels: tuple[Level, ...] = (Level.TOKEN, Level.ENTITY, Level.CONTINUATION)
    kind: str = "baseline"
    is_probability: bool = False
    threshold: float | None = None
    spans: str = "entities"  # online: the segment statistic holding each entity's token indices
    seeds: tuple[TokenStatScorer, ...] = ()  # a trained detector's single seeds, one scorer each (their spread)

    def __post_init__(self) -> None:
        if self.level not in self.levels:
            raise ValueError(
                f"scorer {self.name!r} is not defined at the {self.level.value} level; levels: "
                f"{[x.value for x in self.levels]}"
            )

    @property
    def features(self) -> str:
        return self.stat

    def token(self, values: np.ndarray) -> np.ndarray:
        return values

    def entity(self, values: np.ndarray) -> float:
        return float(np.max(self.token(values)))

    def continuation(self, stats: dict[str, np.ndarray], entities: list[np.ndarray]) -> float:
        return max(self.entity(stats[self.stat][idx]) for idx in entities)

    @property
    def needs(self) -> tuple[str, ...]:
        """The statistics the score is computed from (``spans``: the token indices of each entity)."""
        return (self.stat,) if Level.TOKEN in self.levels else (self.stat, self.spans)

    def token_scores(self, stats: Mapping[str, Any]) -> np.ndarray:
        """The online form: a score for every generated token of a sequence whose per-token statistics are
        ``stats`` (what a RAG trigger reads while the LLM generates). A token-level score scores each token as
        :meth:`token` does; an entity-level one puts each entity's score (:meth:`entity`) on the entity's first
        token, where a generation is cut before it, and -inf elsewhere."""
        values = np.asarray(stats[self.stat], dtype=np.float64)
        if Level.TOKEN in self.levels:
            return np.asarray(self.token(values), dtype=np.float64)
        out = np.full(len(values), -np.inf)
        for idx in stats[self.spans]:
            if len(idx):
                out[idx[0]] = max(out[idx[0]], self.entity(values[np.asarray(idx)]))
        return out

    def score(self, units: pd.DataFrame) -> np.ndarray:
        out = np.full(len(units), np.nan)
        for i, row in enumerate(units.itertuples(index=False)):
            if self.stat not in row.stats:
                continue
            values = row.stats[self.stat]
            if self.level is Level.TOKEN:
                out[i] = float(self.token(values)[0])
            elif self.level is Level.ENTITY:
                out[i] = float(self.entity(values))
            else:
                out[i] = float(self.continuation(row.stats, row.entities))
        return out


def seed_stat(stat: str, seed: int) -> str:
    """The per-token statistic of one seed of a detector whose ensemble's statistic is ``stat``."""
    return f"{stat}[seed {seed}]"


def realtime_detector_scorer(
    level: Level, name: str = "mlp", stat: str = "mlp", seeds: tuple[int, ...] = ()
) -> TokenStatScorer:
    """The real-time detector's probabilities (stat ``mlp``) at ``level``: probabilities at the token level, where it
    was trained; entities take the max over their tokens, continuations the max over their entities. Thresholds
    are chosen on validation at each level (the detector's own threshold is the served one, see
    :func:`detectors.dior.served.served_scorer`). ``seeds``: those of its ensemble, each scored from its own stat
    (:func:`seed_stat`) for the spread across seeds."""
    token = level is Level.TOKEN
    members = tuple(realtime_detector_scorer(level, seed_stat(name, s), seed_stat(stat, s)) for s in seeds)
    return TokenStatScorer(level, name=name, stat=stat, kind="detector", is_probability=token, seeds=members)
