"""Detector networks (plain ``nn.Module``s; Lightning wraps them in ``detectors.training``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence


class EarlyGRU(nn.Module):
    """The early detectors' network: a bidirectional GRU over per-token attribution features, its final
    states joined with per-question features in an MLP head that outputs the hallucination logit. With the
    attribution sequence and its entropy only, it is DioR's RNN over IG(Q) (Eq. 2); see
    :mod:`detectors.dior.early_detector`.

    Per-question features come in two kinds: a few scalars (entropy, first-token statistics) that go
    straight into the head, and a long vector (the hidden state) that is first projected down, so the
    scalars are not drowned among hundreds of hidden dimensions. Any part may be absent (ablation).
    """

    def __init__(self, seq_dim: int, scalar_dim: int, vector_dim: int, hidden: int = 32, dropout: float = 0.2):
        super().__init__()
        if seq_dim == 0 and scalar_dim == 0 and vector_dim == 0:
            raise ValueError("EarlyGRU needs sequence, scalar or vector features")
        self.config = {
            "seq_dim": seq_dim,
            "scalar_dim": scalar_dim,
            "vector_dim": vector_dim,
            "hidden": hidden,
            "dropout": dropout,
        }
        self.gru = nn.GRU(seq_dim, hidden, batch_first=True, bidirectional=True) if seq_dim else None
        self.vector = (
            nn.Sequential(nn.Dropout(dropout), nn.Linear(vector_dim, hidden), nn.GELU()) if vector_dim else None
        )
        self.dropout = nn.Dropout(dropout)
        head_in = (2 * hidden if seq_dim else 0) + (hidden if vector_dim else 0) + scalar_dim
        self.head = nn.Sequential(nn.Linear(head_in, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        if self.gru is not None:
            packed = pack_padded_sequence(batch["seq"], batch["lengths"].cpu(), batch_first=True, enforce_sorted=False)
            _, h = self.gru(packed)  # [2, B, H]
            parts.append(self.dropout(torch.cat([h[0], h[1]], dim=-1)))
        if self.vector is not None:
            parts.append(self.dropout(self.vector(batch["vector"])))
        if self.config["scalar_dim"]:
            parts.append(batch["scalars"])
        return self.head(torch.cat(parts, dim=-1)).squeeze(-1)


class TokenMLP(nn.Module):
    """DioR's real-time detector: an MLP over one generated token's features (hidden states at the
    chosen layers, its probability and entropy) that outputs the hallucination logit."""

    def __init__(self, in_dim: int, hidden: int = 256, dropout: float = 0.3):
        super().__init__()
        self.config = {"in_dim": in_dim, "hidden": hidden, "dropout": dropout}
        self.net = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden // 4),
            nn.GELU(),
            nn.Linear(hidden // 4, 1),
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch["x"]).squeeze(-1)
