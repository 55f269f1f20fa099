"""The one batched decoder: rows' prompts run on the longest prefix already run, then their continuations generated in
lockstep, every chosen token measured (its probability and the entropy of its distribution, and what the probes record
of the pass that runs it). The RAG loop's segments (:mod:`detectors.rag.decoder`), the early set's greedy answers
(:func:`~detectors.dior.early.decode_answers`), the real-time set's continuations
(:func:`~detectors.dior.recorder.generate_traced`) and the LLM's instruction calls (:mod:`detectors.llm.generate`) are
all decoded here, so a token, its probability and its entropy are one computation wherever they are recorded.

**Prompts** (:meth:`Decoder.prefill`). The rows that need a prompt run it on the longest prefix already run (their own
earlier sequence, a sequence in the shared :class:`~detectors.llm.prefill.KVCache`, a prompt several rows continue,
the prefix kept from the last batch), in left-padded batches of similar length. A caller with its prompts' states
already (the early set's question pass, :func:`~detectors.llm.prefill.prefill`) gives rows their states and logits.

**Continuations** (:meth:`Decoder.decode`). Every row generates in lockstep, one batched pass per token, each row
leaving the batch at its own end: end of sequence (not kept), a stop string (the token completing it is not kept:
``Row.stop_token``), the token budget, or the caller's segment end (:meth:`Decoder.ends_segment`). A token is chosen
greedily, or sampled from the row's own random stream (:func:`choose`), from every live row's logits at once: one
host transfer per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from detectors.llm.distribution import entropy
from detectors.llm.kv import KV, PrefixStore, as_cache, common_prefix, crop_kv, join_kv, row_kv, stack_left
from detectors.llm.prefill import KVCache, run_rows, similar_lengths

if TYPE_CHECKING:
    from detectors.llm.loading import LLM


@dataclasses.dataclass(kw_only=True)
class Row:
    """One sequence being decoded: its prompt and the tokens kept after it, what the LLM ran of it (its states, the
    next-token logits, the probes' values of every position run, in chunks), and the continuation being generated with
    each token's probability and entropy."""

    prompt: list[int] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)  # generated earlier and kept: the prompt goes on after
    generator: torch.Generator | None = None  # sample from this stream; None: greedy
    # what the LLM ran for this row, its states and the next logits (None: the prompt must run)
    ran: list[int] = dataclasses.field(default_factory=list)
    kv: Any = None
    logits: torch.Tensor | None = None
    values: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # probe values of ``ran``, chunks
    # the continuation being generated
    gen: list[int] = dataclasses.field(default_factory=list)
    prob: list[float] = dataclasses.field(default_factory=list)
    entropy: list[float] = dataclasses.field(default_factory=list)
    stop_token: int | None = None  # the token that completed a stop string (not in ``gen``)
    done: bool = False  # the sequence is complete (end of sequence, stop string or budget)
    passes: int = 0
    generated: int = 0


class Lockstep:
    """Rows decoding together: one left-padded cache of their own states, its attention mask and each row's padding;
    a row leaves the batch when its continuation ends."""

    def __init__(self, llm: LLM, states: list[KV]):
        lengths = [kv[0][0].shape[2] for kv in states]
        width = max(lengths)
        self.llm, self.rows, self.pads, self.lengths = (
            llm,
            list(range(len(states))),
            [width - n for n in lengths],
            list(lengths),
        )
        self.cache = as_cache(stack_left(states, width), len(states), llm.model.config)
        self.mask = torch.tensor([[0] * p + [1] * n for p, n in zip(self.pads, lengths)], device=llm.device)

    def step(self, tokens: list[int], positions: list[int] | None = None) -> torch.Tensor:
        """Run one token per row (at its own position: by default right after its states); the next-token logits
        ``[rows, vocab]``."""
        device = self.llm.device
        positions = [self.lengths[r] for r in self.rows] if positions is None else positions
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=device)], dim=1)
        out = self.llm.model(
            torch.tensor(tokens, device=device)[:, None],
            attention_mask=self.mask,
            position_ids=torch.tensor(positions, device=device)[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        for r in self.rows:
            self.lengths[r] += 1
        return out.logits[:, -1]

    def kv(self, i: int) -> KV:
        """A copy of row ``i``'s (a position in the batch) own key/value cache."""
        return row_kv(self.cache, i, self.pads[i])

    def drop(self, leaving: list[int]) -> None:
        """Rows at positions ``leaving`` leave the batch."""
        if not leaving:
            return
        keep = [i for i in range(len(self.rows)) if i not in set(leaving)]
        self.rows, self.mask, self.pads = [self.rows[i] for i in keep], self.mask[keep], [self.pads[i] for i in keep]
        if keep:
            self.cache.batch_select_indices(torch.tensor(keep, device=self.llm.device))


def choose(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0) -> int:
    """A token sampled from one row's logits at ``temperature`` from ``generator`` (one uniform, inverse CDF in float64
    on the CPU: the same token whatever the device, batch or neighbours)."""
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return int(torch.searchsorted(cdf, (u * cdf[-1])[None]).clamp_max(len(probs) - 1)[0])


class Decoder:
    """Runs rows' prompts and generates their continuations with ``llm``: up to ``max_new_tokens`` tokens (``kept``
    ones included), a stop string of ``stop`` or an end-of-sequence token of ``eos`` (default: the LLM's), sampled
    rows at ``temperature``. ``probes`` ({key: probe}: context managers whose ``take()`` gives the last pass's values
    ``[rows, positions, d]``) and ``hooks`` (a context manager factory: steering) are attached to every pass;
    ``shared`` (or None) is the cache of sequences others ran with the same hooks; ``batch_size`` bounds a prompt
    pass.

    With ``keep_kv`` a row leaves the batch with a copy of its states and the logits after its last token (the
    caller continues it later: the RAG loop), and the token that ends a row always runs; without, a row's states are
    dropped once the batch holds them, and the token that ends it runs only when probes read its values."""

    def __init__(
        self,
        llm: LLM,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        probes: dict[str, Any] | None = None,
        *,
        hooks: Callable[[], contextlib.AbstractContextManager] | None = None,
        shared: KVCache | None = None,
        batch_size: int = 16,
        eos: set[int] | None = None,
        temperature: float = 1.0,
        keep_kv: bool = False,
    ):
        self.llm, self.max_new_tokens, self.stop = llm, max_new_tokens, tuple(stop)
        self.probes, self.extra_hooks, self.batch_size = dict(probes or {}), hooks, batch_size
        self.temperature, self.keep_kv = temperature, keep_kv
        self.run_last = keep_kv or bool(self.probes)
        self.prefix = PrefixStore(llm, self._hooks, self.probes)
        # states others ran (with the same hooks): reused unless a probe reads the values of every position
        self.shared = shared if not any(getattr(p, "reads_context", False) for p in self.probes.values()) else None
        self.eos = llm.eos_token_ids if eos is None else set(eos)
        self.pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(self.eos or {0})

    @contextlib.contextmanager
    def _hooks(self):
        """The caller's hooks and the probes on the LLM for one of the decoder's passes."""
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if self.extra_hooks is not None:
                stack.enter_context(self.extra_hooks())
            for probe in self.probes.values():
                stack.enter_context(probe)
            yield

    # ---- prompts -------------------------------------------------------------------------------------------
    def prefill(self, rows: list[Row]) -> None:
        """Run every row's prompt and kept tokens on the longest prefix already run (see the module's docstring);
        every sequence run is offered to the shared cache."""
        by_prompt: dict[tuple[int, ...], list] = {}
        on_kv: list[tuple[Row, list[int], int, Any, dict[str, torch.Tensor] | None]] = []
        for row in rows:
            seq = row.prompt + row.kept
            primer = common_prefix(self.prefix.ids, seq)
            own = min(common_prefix(row.ran, seq), len(seq) - 1) if row.kv is not None else 0
            cached, kv = self.shared.lookup(seq) if self.shared is not None else (0, None)
            if own > primer and own >= cached:
                values = {key: torch.cat(v)[:own] for key, v in row.values.items()}
                on_kv.append((row, seq, own, crop_kv(row.kv, own), values))
            elif cached > primer:
                on_kv.append((row, seq, cached, kv, None))  # a reused prefix's probe values are never read
            else:
                by_prompt.setdefault(tuple(row.prompt), []).append((row, seq))
        # rows with the same prompt (the sweep's retrievals at several positions of one answer) run it once, as their
        # shared prefix; the others in batches of similar length
        same = [group for group in by_prompt.values() if len(group) > 1]
        alone = [group[0] for group in by_prompt.values() if len(group) == 1]
        for group in same:
            for start in range(0, len(group), self.batch_size):
                self._prefill_chunk(group[start : start + self.batch_size])
        for idx in similar_lengths([len(seq) for _, seq in alone], self.batch_size):
            self._prefill_chunk([alone[i] for i in idx])
        for idx in similar_lengths([len(seq) - p for _, seq, p, _, _ in on_kv], self.batch_size):
            self._prefill_on_kv([on_kv[i] for i in idx])
        if self.shared is not None:
            for row in rows:
                self.shared.store(row.ran, row.kv)

    def _prefill_on_kv(self, items: list[tuple[Row, list[int], int, Any, dict[str, torch.Tensor] | None]]) -> None:
        """One pass over each row's sequence after a prefix whose states it has (its own, or the shared cache's):
        the prefixes stacked left-padded, the rest right-padded (:func:`~detectors.llm.prefill.run_rows`)."""
        with self._hooks():
            seqs, prefixes = [seq for _, seq, _, _, _ in items], [(p, kv) for _, _, p, kv, _ in items]
            logits, states = run_rows(self.llm, seqs, prefixes, keep_kv=True)
            values = {key: probe.take() for key, probe in self.probes.items()}
        for b, (row, seq, p, _, before) in enumerate(items):
            row.kv, row.logits, row.ran = states[b], logits[b], list(seq)
            new = {key: v[b, : len(seq) - p].clone() for key, v in values.items()}
            row.values = {
                key: [before[key] if before is not None else v.new_zeros(p, v.shape[-1]), v] for key, v in new.items()
            }
            row.passes += 1

    def _prefill_chunk(self, chunk: list[tuple[Row, list[int]]]) -> None:
        """One left-padded pass over the rows' sequences after the prefix they share (kept in the prefix store)."""
        seqs = [seq for _, seq in chunk]
        passes = self.prefix.passes
        shared = self.prefix.get(seqs)
        rests = [s[shared:] for s in seqs]
        width = max(len(r) for r in rests)
        pads = [width - len(r) for r in rests]
        device = self.llm.device
        ids = torch.tensor([[self.pad] * p + r for p, r in zip(pads, rests)], device=device)
        mask = torch.tensor([[1] * shared + [0] * p + [1] * len(r) for p, r in zip(pads, rests)], device=device)
        positions = torch.tensor([[shared + max(i - p, 0) for i in range(width)] for p in pads], device=device)
        past = as_cache(self.prefix.kv, len(chunk), self.llm.model.config) if shared else None
        with self._hooks():
            out = self.llm.model(
                ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, past_key_values=past
            )
            values = {key: probe.take() for key, probe in self.probes.items()}
        for b, ((row, seq), pad) in enumerate(zip(chunk, pads)):
            row.kv = join_kv(self.prefix.kv if shared else None, row_kv(out.past_key_values, b, shared + pad))
            row.logits, row.ran = out.logits[b, -1], list(seq)
            row.values = {
                key: [self.prefix.values[key], v[b, pad:].clone()] if shared else [v[b, pad:].clone()]
                for key, v in values.items()
            }
            row.passes += 1 + (self.prefix.passes - passes)

    # ---- continuations -------------------------------------------------------------------------------------
    def decode(self, rows: list[Row]) -> None:
        """Every row generates its continuation from its states and logits: one batched pass per token, each row
        leaving at its own end (see the module's docstring)."""
        for row in rows:
            row.gen, row.prob, row.entropy, row.stop_token, row.done = [], [], [], None, False
        batch, live = Lockstep(self.llm, [r.kv for r in rows]), list(rows)
        if not self.keep_kv:
            for row in rows:
                row.kv = None  # the batch holds them now

        def leave(idx: list[int]) -> None:
            if self.keep_kv:  # a copy of the row's own states (to continue from, or to reuse)
                for i in idx:
                    live[i].kv = batch.kv(i)
            batch.drop(idx)
            for i in sorted(idx, reverse=True):
                del live[i]

        while live:
            chosen = self._choose(live)
            for row, token in zip(live, chosen):
                if token is not None:
                    self._check_end(row)
                    if not row.done or self.run_last:
                        row.ran.append(token)
            leave([i for i, (r, t) in enumerate(zip(live, chosen)) if t is None or (r.done and not self.run_last)])
            if not live:
                break
            with self._hooks():
                logits = batch.step([r.ran[-1] for r in live], [len(r.ran) - 1 for r in live])  # each at its position
                values = {key: probe.take() for key, probe in self.probes.items()}
            for i, row in enumerate(live):
                row.logits = logits[i]
                row.passes += 1
                for key, v in values.items():
                    row.values.setdefault(key, []).append(v[i])
            leave([i for i, row in enumerate(live) if row.done or self.ends_segment(row)])

    def _choose(self, rows: list[Row]) -> list[int | None]:
        """Every row's next token (greedy, or sampled from its generator) with its probability and its distribution's
        entropy, read to the host in one transfer; None for a row at the end of sequence (``done``, nothing kept)."""
        logits = torch.stack([r.logits for r in rows]).float()
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logp.argmax(-1)
        for b, row in enumerate(rows):
            if row.generator is not None:
                tokens[b] = choose(logits[b], row.generator, self.temperature)
        prob = logp.gather(1, tokens[:, None])[:, 0].exp()
        # float64 holds the ids and the float32 values exactly
        chosen = torch.stack([tokens.double(), prob.double(), entropy(logp).double()], dim=1).tolist()
        out: list[int | None] = []
        for row, (t, p, e) in zip(rows, chosen):
            token = int(t)
            if token in self.eos:
                row.done = True
                out.append(None)
                continue
            row.gen.append(token)
            row.prob.append(p)
            row.entropy.append(e)
            row.generated += 1
            out.append(token)
        return out

    def _check_end(self, row: Row) -> None:
        """After a token was chosen: a stop string completed (the token leaves ``gen`` for ``stop_token``) or the
        budget reached makes the row ``done``."""
        if self.stop and any(
            s in self.llm.tokenizer.decode(row.kept + row.gen, skip_special_tokens=True) for s in self.stop
        ):
            row.stop_token = row.gen.pop()
            row.prob.pop()
            row.entropy.pop()
            row.done = True
        elif len(row.kept) + len(row.gen) >= self.max_new_tokens:
            row.done = True

    def ends_segment(self, row: Row) -> bool:
        """After a token of a row that is not done ran: whether the row leaves the batch there (a caller's segment
        end; by default a row decodes to its end)."""
        return False

    def final_text(self, ids: list[int]) -> str:
        """The text of ``ids`` up to the first stop string, stripped."""
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop:
            text = text.split(s, 1)[0]
        return text.strip()
