"""Prompts that run once: a cache of the key/value states of token sequences already run (:class:`KVCache`, the
prefix caching of serving engines such as vLLM), a batched prefill of many prompts that each continue their longest
cached prefix (:func:`prefill`); the states it leaves are decoded by :mod:`detectors.llm.decoder`.

A prompt's states depend only on its own tokens, so any later prompt that begins with the same tokens continues from
them instead of running them again: an evaluator's instruction shared by every row, a reference shown to several
candidates, evidence scored again against a new query, a prompt that grows by an item from one iteration to the next.
:func:`prefill` first runs, once, every prefix that several of its rows share (and the cache lacks), then each row's
remaining tokens on its longest cached prefix, rows of similar length batched together (their prefixes stacked
left-padded, the padding masked out).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from detectors.llm.kv import KV, as_cache, common_prefix, crop_kv, row_kv, stack_left

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

BLOCK = 16  # tokens per hashed block of the cache's index
MIN_SHARED = 16  # a prefix rows share is run once when it is at least this long


@dataclasses.dataclass
class _Entry:
    ids: list[int]
    kv: KV
    bytes: int


class KVCache:
    """Key/value states of token sequences, found again by any sequence that begins with one of them (the longest
    cached prefix wins), kept within ``max_bytes`` (least recently used first out). A sequence that extends a cached
    one replaces it. Entries are indexed by the hashes of their ``BLOCK``-token prefixes, then compared token by
    token, so a lookup costs a few hashes of the prompt, whatever the number of entries."""

    def __init__(self, max_bytes: int = 4 << 30):
        self.max_bytes = int(max_bytes)
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.index: dict[int, set[int]] = {}
        self.bytes, self.hits, self.reused, self._next = 0, 0, 0, 0

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def _blocks(ids: Sequence[int]) -> list[int]:
        return [hash(tuple(ids[:end])) for end in range(BLOCK, len(ids) + 1, BLOCK)]

    def lookup(self, ids: Sequence[int], limit: int | None = None) -> tuple[int, KV | None]:
        """The longest cached prefix of ``ids`` of at most ``limit`` tokens (default: all but the last token, whose
        logits the caller needs) and its states (views); ``(0, None)`` when none."""
        limit = len(ids) - 1 if limit is None else min(limit, len(ids))
        best, entry = 0, None
        candidates: set[int] = set()
        # entries sharing the longest run of whole blocks (shorter prefixes are not worth it)
        for key in self._blocks(ids):
            found = self.index.get(key)
            if not found:
                break
            candidates = found
        for key in candidates:
            e = self.entries[key]
            n = min(common_prefix(e.ids, ids), limit)
            if n > best:
                best, entry = n, key
        if entry is None:
            return 0, None
        self.entries.move_to_end(entry)
        self.hits, self.reused = self.hits + 1, self.reused + best
        return best, crop_kv(self.entries[entry].kv, best)

    def store(self, ids: Sequence[int], kv: KV) -> None:
        """Keep the states ``kv`` of ``ids[:n]`` (n: their length), dropping the entries it extends."""
        n = kv[0][0].shape[2]
        ids = list(ids[:n])
        if n < BLOCK:
            return
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        blocks = self._blocks(ids)
        for key in list(self.index.get(blocks[-1], ())):  # an entry this one extends (or repeats) is dropped
            if len(self.entries[key].ids) <= n and common_prefix(self.entries[key].ids, ids) == len(
                self.entries[key].ids
            ):
                self._drop(key)
        for key in list(self.index.get(blocks[-1], ())):
            if common_prefix(self.entries[key].ids, ids) >= n:  # already covered by a longer entry
                self.entries.move_to_end(key)
                return
        key, self._next = self._next, self._next + 1
        self.entries[key] = _Entry(ids, kv, size)
        for block in blocks:
            self.index.setdefault(block, set()).add(key)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        e = self.entries.pop(key)
        self.bytes -= e.bytes
        for block in self._blocks(e.ids):
            keys = self.index.get(block)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.index[block]


def similar_lengths(lengths: Sequence[int], batch_size: int, tokens: int = 16384) -> list[list[int]]:
    """Indices in batches of at most ``batch_size`` rows and ``tokens`` tokens whose lengths differ by at most an eighth
    (or 8 tokens), shortest first: the padding of a batched pass stays small (a prompt's pass is arithmetic-bound on a
    CPU: padding costs, batching buys little)."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n, last = lengths[i], out[-1] if out else None
        if (
            last is None
            or len(last) >= batch_size
            or (len(last) + 1) * n > tokens
            or n - lengths[last[0]] > max(8, n // 8)
        ):
            out.append([i])
        else:
            last.append(i)
    return out


def shared_prefixes(rows: list[list[int]], min_len: int = MIN_SHARED) -> list[tuple[int, ...]]:
    """The prefixes that two or more rows share at their longest (the trie nodes where rows part ways), shortest first,
    each kept only when it is at least ``min_len`` tokens longer than the longest kept prefix it extends (and shorter
    than the rows that share it): a prefix run once is worth its own pass only when it saves that many tokens a row."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    found: set[tuple[int, ...]] = set()
    for a, b in zip(order, order[1:]):
        n = min(common_prefix(rows[a], rows[b]), len(rows[a]) - 1, len(rows[b]) - 1)
        if n >= min_len:
            found.add(tuple(rows[a][:n]))
    kept: list[tuple[int, ...]] = []
    for prefix in sorted(found, key=len):
        parent = max((len(k) for k in kept if prefix[: len(k)] == k), default=0)
        if len(prefix) - parent >= min_len:
            kept.append(prefix)
    return kept


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The output head over final hidden states ``[R, H]`` (with the model's logit soft-capping, if any): the logits
    of the positions asked for only, not of every position."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


OnBatch = Callable[[list[int], int, float], None]  # (row indices, forward calls, seconds) of one batched call


@dataclasses.dataclass
class Prefilled:
    """What :func:`prefill` leaves of each row: the next-token logits after its last token (float32) and, when asked
    for, the states of all its tokens."""

    logits: list[torch.Tensor]
    kv: list[KV | None]


def run_rows(
    llm: LLM, rows: list[list[int]], prefixes: list[tuple[int, KV | None]], keep_kv: bool
) -> tuple[torch.Tensor, list[KV | None]]:
    """One forward pass of each row's tokens after its cached prefix (``(length, states)``; the prefixes stacked
    left-padded to the longest, the new tokens right-padded, the padding masked out): the float32 logits at each row's
    last token and, with ``keep_kv``, each row's states (prefix and new). Hooks attached by the caller see the new
    positions ``[rows, longest rest, ...]``."""
    device, config = llm.device, llm.model.config
    lengths = [p for p, _ in prefixes]
    width = max(lengths)
    rests = [r[p:] for r, p in zip(rows, lengths)]
    n = max(len(r) for r in rests)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (n - len(r)) for r in rests], device=device)
    mask = torch.tensor(
        [[0] * (width - p) + [1] * (p + len(r)) + [0] * (n - len(r)) for p, r in zip(lengths, rests)], device=device
    )
    positions = torch.tensor(
        [[p + min(i, len(r) - 1) for i in range(n)] for p, r in zip(lengths, rests)], device=device
    )
    cache = None
    if width:
        dims = next(kv for _, kv in prefixes if kv is not None)
        empty = [(k[:, :, :0], v[:, :, :0]) for k, v in dims]
        cache = as_cache(stack_left([kv if kv is not None else empty for _, kv in prefixes], width), len(rows), config)
    last = torch.tensor([len(r) - 1 for r in rests], device=device)
    decoder = llm.model.get_decoder()
    with torch.no_grad():
        out = decoder(
            ids,
            attention_mask=mask if width or len(set(map(len, rests))) > 1 else None,
            position_ids=positions,
            past_key_values=cache,
            use_cache=keep_kv or cache is not None,
        )
        logits = head_logits(llm.model, out.last_hidden_state[torch.arange(len(rows), device=device), last]).float()
    states: list[KV | None] = [None] * len(rows)
    if keep_kv:
        for b, (_p, r) in enumerate(zip(lengths, rests)):
            own = row_kv(out.past_key_values, b, width)  # this row's new positions (and its right padding)
            own = [(k[:, :, : len(r)], v[:, :, : len(r)]) for k, v in own]
            prefix = prefixes[b][1]
            states[b] = (
                own
                if prefix is None
                else [(torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)) for (pk, pv), (k, v) in zip(prefix, own)]
            )
    return logits, states


def prefill(
    llm: LLM,
    rows: list[list[int]],
    cache: KVCache | None = None,
    batch_size: int = 16,
    keep_kv: bool = False,
    on_batch: OnBatch | None = None,
) -> Prefilled:
    """Run every row (token ids, each at least one token) on its longest cached prefix: first, once each, the prefixes
    several rows share that ``cache`` lacks (a call-local cache when None), then the rows, ``batch_size`` at a time in
    batches of similar length. Every row's states are stored in ``cache`` when one is given (so a later call reuses
    them). ``on_batch`` hears of every pass: its rows (a shared prefix's pass is reported for each row it serves), one
    forward call, its seconds."""
    if any(not r for r in rows):
        raise ValueError("prefill: every row needs at least one token")
    store = cache if cache is not None else KVCache()
    for prefix in shared_prefixes(rows):
        p, kv = store.lookup(prefix, limit=len(prefix))
        if p == len(prefix):
            continue
        start = time.perf_counter()
        _, (states,) = run_rows(llm, [list(prefix)], [(p, kv)], keep_kv=True)
        store.store(prefix, states)
        if on_batch is not None:
            on_batch(
                [i for i, r in enumerate(rows) if tuple(r[: len(prefix)]) == prefix], 1, time.perf_counter() - start
            )
    found = [store.lookup(r) for r in rows]
    logits: list[torch.Tensor | None] = [None] * len(rows)
    states: list[KV | None] = [None] * len(rows)
    for idx in similar_lengths([len(r) - p for r, (p, _) in zip(rows, found)], batch_size):
        start = time.perf_counter()
        out, kept = run_rows(llm, [rows[i] for i in idx], [found[i] for i in idx], keep_kv or cache is not None)
        for b, i in enumerate(idx):
            logits[i], states[i] = out[b], kept[b]
            if cache is not None:
                cache.store(rows[i], kept[b])
        if on_batch is not None:
            on_batch(list(idx), 1, time.perf_counter() - start)
    return Prefilled(logits, states if keep_kv else [None] * len(rows))  # type: ignore[arg-type]
