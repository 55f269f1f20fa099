"""FLARE (Jiang et al. 2023): retrieve when a generated token's probability is low. A token scores
``1 - p``; a continuation scores its least probable token (FLARE's trigger over the whole continuation)."""

from __future__ import annotations

import dataclasses

import numpy as np

from detectors.evaluation.scorers import TokenStatScorer
from detectors.interfaces import Level


@dataclasses.dataclass(frozen=True)
class Flare(TokenStatScorer):
    name: str = "flare"
    stat: str = "prob"
    levels: tuple[Level, ...] = (Level.TOKEN, Level.CONTINUATION)

    def token(self, values: np.ndarray) -> np.ndarray:
        return 1 - values

    def continuation(self, stats: dict[str, np.ndarray], entities: list[np.ndarray]) -> float:
        return float(1 - stats[self.stat].min())
