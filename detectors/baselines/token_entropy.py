"""Predictive entropy of each generated token's distribution; an entity takes its most uncertain token."""

from __future__ import annotations

import dataclasses

from detectors.evaluation.scorers import TokenStatScorer


@dataclasses.dataclass(frozen=True)
class TokenEntropy(TokenStatScorer):
    name: str = "token_entropy"
    stat: str = "entropy"
