"""Key/value-prefix reuse and batched forward passes: a prompt prefix shared by many rows runs once.

IG runs every interpolation step on the cached prompt before the question, CtrlA runs every statement
on the cached instruction, TruthfulQA runs every candidate answer on the cached question.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per-layer (keys, values) of a batch-1 prompt prefix


def prefix_states(model: PreTrainedModel, input_ids: torch.Tensor, end: int) -> KV | None:
    """Key/value states of ``input_ids[:, :end]`` (None when ``end`` is 0)."""
    if end == 0:
        return None
    with torch.no_grad():
        return cache_states(model(input_ids[:, :end], use_cache=True).past_key_values)


def as_cache(prefix: KV | None, rows: int, config) -> DynamicCache | None:
    """A fresh cache holding ``prefix`` for ``rows`` sequences (views: the prefix itself is never changed)."""
    if not prefix:
        return None
    return DynamicCache(ddp_cache_data=[(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in prefix], config=config)


def cache_states(cache) -> KV:
    """The per-layer (keys, values) of a model's returned cache, reusable with :func:`as_cache`."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def prefix_cache(llm: "LLM", prefix: list[int]) -> KV | None:
    """Key/value states of a token prefix shared by many rows (computed once, under whatever hooks are active)."""
    return prefix_states(llm.model, torch.tensor([prefix], device=llm.device), len(prefix)) if prefix else None


def shared_prefix_length(rows: list[list[int]]) -> int:
    """How many leading tokens every row shares, leaving each row at least one token of its own (its last
    position's logits or states are then computed with the row)."""
    shortest = min(len(r) for r in rows) - 1
    first = rows[0]
    return next((i for i in range(shortest) if any(r[i] != first[i] for r in rows)), shortest)


def batches(rows: list[list[int]], batch_size: int) -> Iterator[list[int]]:
    """Indices of ``rows`` in batches of similar length (less padding)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for k in range(0, len(order), batch_size):
        yield order[k : k + batch_size]


def forward_rows(llm: "LLM", kv: KV | None, rows: list[list[int]], logits: bool = False):
    """One forward pass of ``prefix + row`` for every row, the prefix given as its cached states ``kv``.

    Rows are right-padded; causal attention keeps real tokens from seeing the padding, so no mask is
    needed. Positions continue after the prefix. Logits for every row position only when ``logits``.
    """
    pad = llm.tokenizer.pad_token_id or 0
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=llm.device)
    cache = as_cache(kv, len(rows), llm.model.config)
    with torch.no_grad():
        return llm.model(ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=0 if logits else 1)
