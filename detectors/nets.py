"""Detector networks (plain ``nn.Module``s; Lightning wraps them in ``detectors.training``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence


class EarlyGRU(nn.Module):
    """DioR's early detector: a bidirectional GRU over per-token attribution features, its final
    states joined with per-question features (entropy, first-token statistics, hidden state) in an
    MLP head that outputs the hallucination logit. Either part may be absent (feature ablation)."""

    def __init__(self, seq_dim: int, static_dim: int, hidden: int = 32, dropout: float = 0.2):
        super().__init__()
        if seq_dim == 0 and static_dim == 0:
            raise ValueError("EarlyGRU needs sequence or static features")
        self.config = {"seq_dim": seq_dim, "static_dim": static_dim, "hidden": hidden, "dropout": dropout}
        self.gru = nn.GRU(seq_dim, hidden, batch_first=True, bidirectional=True) if seq_dim else None
        self.static = nn.Sequential(nn.LayerNorm(static_dim), nn.Dropout(dropout), nn.Linear(static_dim, hidden), nn.GELU()) if static_dim else None
        head_in = (2 * hidden if seq_dim else 0) + (hidden if static_dim else 0)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(head_in, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        if self.gru is not None:
            packed = pack_padded_sequence(batch["seq"], batch["lengths"].cpu(), batch_first=True, enforce_sorted=False)
            _, h = self.gru(packed)  # [2, B, H]
            parts.append(torch.cat([h[0], h[1]], dim=-1))
        if self.static is not None:
            parts.append(self.static(batch["static"]))
        return self.head(torch.cat(parts, dim=-1)).squeeze(-1)
