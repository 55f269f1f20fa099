"""A Stitch in Time (Varshney et al. 2023, §2.1.2): concept-level logit uncertainty from the probabilities
of an entity's tokens — their minimum (MIN), mean (AVG) or normalised product (NORM); a continuation
scores its most uncertain entity."""

from __future__ import annotations

import dataclasses

import numpy as np

from detectors.evaluation.scorers import TokenStatScorer
from detectors.interfaces import Level


@dataclasses.dataclass(frozen=True)
class _StitchInTime(TokenStatScorer):
    """An entity's score from its tokens' probabilities; defined for entities and continuations."""

    stat: str = "prob"
    levels: tuple[Level, ...] = (Level.ENTITY, Level.CONTINUATION)


@dataclasses.dataclass(frozen=True)
class SitMin(_StitchInTime):
    name: str = "sit_min"

    def entity(self, values: np.ndarray) -> float:
        return float(1 - values.min())


@dataclasses.dataclass(frozen=True)
class SitAvg(_StitchInTime):
    name: str = "sit_avg"

    def entity(self, values: np.ndarray) -> float:
        return float(1 - values.mean())


@dataclasses.dataclass(frozen=True)
class SitNorm(_StitchInTime):
    name: str = "sit_norm"

    def entity(self, values: np.ndarray) -> float:
        return float(1 - np.exp(np.log(np.clip(values, 1e-12, None)).mean()))
