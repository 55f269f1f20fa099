"""Statistics of the LLM's next-token distribution, one definition for every reader of it."""

from __future__ import annotations

import torch


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the distributions whose log-probabilities are ``logp``'s last dimension (a token of
    probability 0 contributes 0, not NaN)."""
    return -(logp.exp() * logp).nan_to_num().sum(-1)
