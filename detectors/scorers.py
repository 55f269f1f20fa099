"""Scorers: anything that gives each example a hallucination score (higher = more likely hallucinated).

Trained detectors and training-free baselines sit behind the same small interface, so the
evaluation scores them all the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import pandas as pd

from detectors.early import scalar_features
from detectors.metrics import fit_logistic


class Scorer(Protocol):
    name: str
    kind: str  # "detector" | "baseline"
    is_probability: bool  # False: evaluation maps scores to probabilities by a Platt fit on validation
    features: str  # what the score is computed from, for the MLflow run

    def score(self, frame: pd.DataFrame) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class ColumnScorer:
    """A training-free score read from one stored feature column, negated when low means hallucinated."""

    name: str
    column: str
    higher_is_hallucinated: bool = True
    kind: str = "baseline"
    is_probability: bool = False
    threshold: float | None = None  # None: chosen on validation by the evaluation

    @property
    def features(self) -> str:
        return self.column

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        values = frame[self.column].to_numpy(dtype=np.float64)
        return values if self.higher_is_hallucinated else -values


EARLY_BASELINES: tuple[ColumnScorer, ...] = (
    ColumnScorer("attribution_entropy", "entropy"),  # DioR Eq. 1 alone
    ColumnScorer("first_token_prob", "first_token_prob", higher_is_hallucinated=False),
    ColumnScorer("first_token_entropy", "first_token_entropy"),
)


def summary_features(frame: pd.DataFrame) -> np.ndarray:
    """Inputs of the logistic-regression baseline: the detector's entropy and first-token scalars,
    plus the peak of the attribution distribution (a summary in place of the whole sequence)."""
    return np.stack(
        [np.r_[scalar_features(row, ["entropy", "first_token"]), max(row["attribution"])] for row in frame.to_dict("records")]
    )


@dataclasses.dataclass
class LogisticScorer:
    """The early-detection probe the GRU is measured against: a logistic regression on attribution
    summaries and first-token statistics, fitted on the train split only."""

    name: str = "logreg[attribution+first_token]"
    kind: str = "baseline"
    is_probability: bool = True
    features: str = "attribution summary, first_token"

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        train = frame[frame["split"] == "train"]
        model = fit_logistic(summary_features(train), train["label"], l2=1e-2, smooth=False)
        return model(summary_features(frame))


@dataclasses.dataclass
class DetectorScorer:
    """A trained detector scoring stored feature rows with its own threshold."""

    name: str
    detector: object  # EarlyDetector (anything with predict_rows and threshold)
    kind: str = "detector"
    is_probability: bool = True

    @property
    def features(self) -> str:
        return ",".join(self.detector.groups)

    @property
    def threshold(self) -> float:
        return self.detector.threshold

    def score(self, frame: pd.DataFrame) -> np.ndarray:
        return self.detector.predict_rows(frame.to_dict("records"))
