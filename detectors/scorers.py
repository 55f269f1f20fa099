"""Scorers: anything that gives each example a hallucination score (higher = more likely hallucinated).

Trained detectors and training-free baselines sit behind the same small interface, so the
evaluation scores them all the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import pandas as pd


class Scorer(Protocol):
    name: str
    kind: str  # "detector" | "baseline"
    is_probability: bool  # False: evaluation maps scores to probabilities by a Platt fit on validation

    def score(self, frame: pd.DataFrame) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class ColumnScorer:
    """A training-free score read from one stored feature column, negated when low means hallucinated."""

    name: str
    column: str
    higher_is_hallucinated: bool = True
    kind: str = "baseline"
    is_probability: bool = False

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        values = frame[self.column].to_numpy(dtype=np.float64)
        return values if self.higher_is_hallucinated else -values


EARLY_BASELINES: tuple[ColumnScorer, ...] = (
    ColumnScorer("attribution_entropy", "entropy"),  # DioR Eq. 1 alone
    ColumnScorer("first_token_prob", "first_token_prob", higher_is_hallucinated=False),
    ColumnScorer("first_token_entropy", "first_token_entropy"),
)


@dataclasses.dataclass
class DetectorScorer:
    """A trained detector scoring stored feature rows with its own threshold."""

    name: str
    detector: object  # EarlyDetector (anything with predict_rows and threshold)
    kind: str = "detector"
    is_probability: bool = True

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        return self.detector.predict_rows(frame.to_dict("records"))
