"""The early-detection probe the GRU is measured against: a logistic regression on attribution summaries
and first-token statistics, fitted on the train split only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from detectors.dior.early import scalar_features
from detectors.evaluation.metrics import fit_logistic
from detectors.interfaces import Level


def summary_features(frame: pd.DataFrame) -> np.ndarray:
    """Inputs of the probe: the detector's entropy and first-token scalars, plus the peak of the
    attribution distribution (a summary in place of the whole sequence)."""
    return np.stack(
        [
            np.r_[scalar_features(row, ["entropy", "first_token"]), max(row["attribution"])]
            for row in frame.to_dict("records")
        ]
    )


@dataclasses.dataclass
class LogisticScorer:
    """Fitted on the train split, so a trained baseline: listed apart from the training-free ones, never the baseline
    a detector's paired difference is measured against."""

    name: str = "logreg[attribution+first_token]"
    level: Level = Level.QUESTION
    kind: str = "trained baseline"
    is_probability: bool = True
    threshold: float | None = None
    features: str = "attribution summary, first_token"
    columns: tuple[str, ...] = (
        "attribution",
        "entropy",
        "first_token_prob",
        "first_token_entropy",
        "first_token_margin",
    )

    def score(self, units: pd.DataFrame) -> np.ndarray:
        train = units[units["split"] == "train"]
        model = fit_logistic(summary_features(train), train["label"], l2=1e-2, smooth=False)
        return model(summary_features(units))
