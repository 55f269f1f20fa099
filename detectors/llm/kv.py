"""Key/value-prefix reuse and batched forward passes: a prompt prefix shared by many rows runs once.

IG runs every interpolation step on the cached prompt before the question, CtrlA runs every statement
on the cached instruction, TruthfulQA runs every candidate answer on the cached question.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per-layer (keys, values) of a batch-1 prompt prefix


def prefix_kv(model: PreTrainedModel, input_ids: torch.Tensor, end: int) -> KV | None:
    """Key/value states of ``input_ids[:, :end]`` (None when ``end`` is 0)."""
    if end == 0:
        return None
    with torch.no_grad():
        return cache_kv(model(input_ids[:, :end], use_cache=True).past_key_values)


class _GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose states sit in a buffer with room to grow, so that appending a decoded token
    writes one position instead of copying every cached one (``DynamicLayer`` concatenates at each step: on a CPU that
    copy was a third of a decoding step). ``keys``/``values`` are views of the filled part; a method of the base class
    that replaces them (``batch_select_indices``, ``crop``) is followed by a fresh buffer at the next update."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self.get_seq_length(), key_states.shape[-2]
        buffer = getattr(self, "_buffer", None)
        fits = (
            buffer is not None
            and self.keys is self._view
            and n + new <= buffer[0].shape[-2]
            and buffer[0].shape[0] == key_states.shape[0]
        )
        if not fits:
            room = n + new + max(32, (n + new) // 2)
            b, h, _, d = key_states.shape
            buffer = (key_states.new_empty(b, h, room, d), value_states.new_empty(b, h, room, value_states.shape[-1]))
            if n:
                buffer[0][:, :, :n], buffer[1][:, :, :n] = self.keys, self.values
            self._buffer = buffer
        buffer[0][:, :, n : n + new], buffer[1][:, :, n : n + new] = key_states, value_states
        self.keys, self.values = buffer[0][:, :, : n + new], buffer[1][:, :, : n + new]
        self._view = self.keys
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers grow in place (:class:`_GrowingLayer`); other layer kinds (sliding
    windows) are kept as transformers makes them."""

    def __init__(self, ddp_cache_data=None, config=None):
        super().__init__(config=config)
        if self.layer_class_to_replicate is DynamicLayer:  # no config: layers made as they are first updated
            self.layer_class_to_replicate = _GrowingLayer
        self.layers = [_GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        for idx, (k, v) in enumerate(ddp_cache_data or ()):
            self.update(k, v, idx)


def as_cache(prefix: KV | None, rows: int, config) -> DynamicCache | None:
    """A fresh cache holding ``prefix`` for ``rows`` sequences (copied into the cache's own buffers: the prefix itself
    is never changed), growing in place as tokens are appended (:class:`GrowingCache`)."""
    if not prefix:
        return None
    return GrowingCache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in prefix], config=config)


def cache_kv(cache) -> KV:
    """The per-layer (keys, values) of a model's returned cache, reusable with :func:`as_cache`."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def prefix_cache(llm: LLM, prefix: list[int]) -> KV | None:
    """Key/value states of a token prefix shared by many rows (computed once, under whatever hooks are active)."""
    return prefix_kv(llm.model, torch.tensor([prefix], device=llm.device), len(prefix)) if prefix else None


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


def forward_rows(llm: LLM, kv: KV | None, rows: list[list[int]], logits: bool = False):
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


class ForwardCounter:
    """Counts the forward calls of a module while attached (``with ForwardCounter(model) as c: ...; c.calls``)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.calls, self._handle = model, 0, None

    def __enter__(self) -> ForwardCounter:
        self._handle = self.model.register_forward_pre_hook(self._count)
        return self

    def _count(self, module, args) -> None:
        self.calls += 1

    def __exit__(self, *exc) -> None:
        self._handle.remove()


# ---- rows of a left-padded batch: each row's cache is a contiguous suffix of the batch's positions ----------


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def crop_kv(kv: KV, length: int) -> KV:
    """The first ``length`` positions of cached states (views: the key/value of a position depends only on the
    positions before it, so a prefix of a cache is the cache of the prefix)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def stack_left(rows: list[KV], width: int) -> KV:
    """One batch cache of per-row states ``[1, heads, n_r, dim]`` left-padded with zeros to ``width`` positions
    (the padding is masked out by the caller's attention mask)."""
    out = []
    for layer in range(len(rows[0])):
        ks, vs = [], []
        for row in rows:
            k, v = row[layer]
            pad = width - k.shape[2]
            ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
            vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
        out.append((torch.cat(ks), torch.cat(vs)))
    return out


def row_kv(cache, row: int, start: int) -> KV:
    """A copy of row ``row``'s states from position ``start`` on (its real positions in a left-padded batch cache);
    a copy, so that the batch's tensors can be freed."""
    return [
        (layer.keys[row : row + 1, :, start:].clone(), layer.values[row : row + 1, :, start:].clone())
        for layer in cache.layers
    ]


def join_kv(prefix: KV | None, rest: KV) -> KV:
    """A prefix's states followed by a row's own."""
    if not prefix:
        return rest
    return [(torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)) for (pk, pv), (k, v) in zip(prefix, rest)]


class PrefixStore:
    """The states of a token prefix shared by the rows of a batch, kept between batches: the next batch reuses
    what it shares with the kept prefix (cropped) and runs only the rest of its own shared prefix.

    ``probes`` (objects with ``take() -> [B, T, d]``, attached by ``hooks``) record values of every position the
    LLM runs; the store keeps theirs for the prefix too (``values``), cropped and extended with it."""

    def __init__(self, llm: LLM, hooks=None, probes: dict | None = None):
        self.llm, self.hooks, self.probes = llm, hooks, dict(probes or {})
        self.ids: list[int] = []
        self.kv: KV | None = None
        self.values: dict[str, torch.Tensor] = {}  # probe key -> [len(ids), d]
        self.passes = 0  # forward passes run for prefixes

    def get(self, rows: list[list[int]]) -> int:
        """Make the store hold the prefix every row shares (leaving each at least one token of its own); returns
        its length (0: nothing shared)."""
        shared = shared_prefix_length(rows)
        kept = min(common_prefix(self.ids, rows[0]), shared)
        if kept == len(self.ids) == shared:
            return shared
        kv = crop_kv(self.kv, kept) if kept and self.kv else None
        values = {key: v[:kept] for key, v in self.values.items()} if kept else {}
        if shared > kept:
            ids = torch.tensor([rows[0][kept:shared]], device=self.llm.device)
            positions = torch.arange(kept, shared, device=self.llm.device)[None]
            with torch.no_grad(), self.hooks() if self.hooks else _null():
                out = self.llm.model(
                    ids,
                    position_ids=positions,
                    past_key_values=as_cache(kv, 1, self.llm.model.config),
                    use_cache=True,
                    logits_to_keep=1,
                )
                new = {key: probe.take()[0] for key, probe in self.probes.items()}
            self.passes += 1
            kv = cache_kv(out.past_key_values)
            values = {key: torch.cat([values[key], v]) if key in values else v for key, v in new.items()}
        self.ids, self.kv, self.values = list(rows[0][:shared]), kv, values
        return shared


def _null():
    import contextlib

    return contextlib.nullcontext()
