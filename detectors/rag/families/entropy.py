"""Cheap uncertainty triggers (the adaptive-retrieval study arXiv 2501.12835, which finds such scores as accurate as
complex pipelines at a fraction of the calls): the LLM's own token entropies decide. Both judge a generated segment
and, when they fire, retrieve with the question and generate the segment again with the passages, which stands (the
study's procedure: answer, measure, retrieve once and answer again).

- ``entropy_max``: the most uncertain token of the segment (it fires when any token's entropy reaches the threshold);
- ``entropy_mean``: the mean entropy of the segment's tokens (the study's "Mean Entropy"; with short answers the
  segment is the whole answer)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from detectors.baselines.token_entropy import TokenEntropy
from detectors.evaluation.scorers import TokenStatScorer
from detectors.interfaces import Level
from detectors.rag.triggers import Policy, Trigger, TriggerContext, TriggerEntry

ENTROPY = (0.0, math.inf)  # nats


@dataclasses.dataclass(frozen=True)
class MeanTokenEntropy(TokenStatScorer):
    """The mean predictive entropy of a segment's tokens, on its last token (every other token scores -inf): the
    segment is judged once it is generated."""

    name: str = "entropy_mean"
    stat: str = "entropy"
    levels: tuple[Level, ...] = (Level.CONTINUATION,)

    def continuation(self, stats: dict[str, np.ndarray], entities: list[np.ndarray]) -> float:
        return float(np.mean(stats[self.stat]))

    @property
    def needs(self) -> tuple[str, ...]:
        return (self.stat,)

    def token_scores(self, stats: Mapping[str, Any]) -> np.ndarray:
        values = np.asarray(stats[self.stat], dtype=np.float64)
        out = np.full(len(values), -np.inf)
        if len(values):
            out[-1] = float(values.mean())
        return out


def build_max(context: TriggerContext, settings: None) -> Trigger:
    return Trigger(
        "entropy_max",
        TokenEntropy(Level.TOKEN, name="entropy_max"),
        math.inf,
        Policy("token", cut="segment", after_retrieval="accept"),
        scores=ENTROPY,
    )


def build_mean(context: TriggerContext, settings: None) -> Trigger:
    return Trigger(
        "entropy_mean",
        MeanTokenEntropy(Level.CONTINUATION),
        math.inf,
        Policy("token", cut="segment", after_retrieval="accept"),
        scores=ENTROPY,
    )


ENTROPY_MAX = TriggerEntry(build_max, offline=TokenEntropy)
ENTROPY_MEAN = TriggerEntry(build_mean, offline=MeanTokenEntropy)
