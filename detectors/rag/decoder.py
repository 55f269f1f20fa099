"""The RAG loop's batched decoder: many questions' prompts run on the longest prefix already run, then their next
segments generated in lockstep, every token measured (its probability and entropy, and what the probes record).

**Prompts.** The rows that need a prompt run it on the longest prefix already run (their own earlier prompt when a
retrieval returned the same first passages; a sequence another configuration ran, from the shared
:class:`~detectors.llm.states.StateCache`; a prompt several rows continue; the few-shot primer, cached once and kept
between batches), in left-padded batches of similar length (a prompt's pass is arithmetic-bound: padding costs,
batching buys nothing).

**Segments.** Every row generates its next segment in lockstep, one batched pass per token, each row leaving the batch
at its own stop: a sentence end (unless the row's answer is one segment), a stop string, end of sequence or the token
budget. Decoding is greedy, as the early set's answers are.

The decoder knows nothing of triggers or retrieval: :class:`~detectors.rag.loop.RagLoop` decides what a row's prompt
is and what happens to its segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import numpy as np
import torch

from detectors.llm.distribution import entropy
from detectors.llm.kv import PrefixStore, as_cache, common_prefix, crop_states, join_states, row_states
from detectors.llm.loading import LLM
from detectors.llm.states import Lockstep, StateCache, run_rows, similar_lengths
from detectors.rag.results import Retrieval
from detectors.rag.stats import Calculator, SegmentView

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclasses.dataclass
class Row:
    """One question's state: what the decoder runs (its prompt and kept answer tokens, its states, the segment being
    generated) and what the loop and the controllers record of it."""

    question: str
    record: bool = False  # keep every prompt the LLM continued
    kept: list[int] = dataclasses.field(default_factory=list)
    query: str | None = None  # retrieve with this query before generating (the sweep); None: question triggers decide
    whole: bool = False  # the answer is one segment (no cut at sentence ends)
    retrievals: list[Retrieval] = dataclasses.field(default_factory=list)
    question_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    question_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    prompt: list[int] = dataclasses.field(default_factory=list)
    prompts: list[str] = dataclasses.field(default_factory=list)
    # what the LLM ran for this row (a prompt and what was generated after it), its states and the next logits (None:
    # the current prompt must run)
    ran: list[int] = dataclasses.field(default_factory=list)
    kv: Any = None
    logits: torch.Tensor | None = None
    values: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # probe values of ``ran``, chunks
    # the segment being generated
    gen: list[int] = dataclasses.field(default_factory=list)
    prob: list[torch.Tensor] = dataclasses.field(default_factory=list)
    entropy: list[torch.Tensor] = dataclasses.field(default_factory=list)
    done: bool = False  # the answer is complete
    finished: bool = False
    error: str | None = None
    passes: int = 0
    generated: int = 0
    seconds: float = 0.0  # measurements reused from another configuration
    segments: list[SegmentView] = dataclasses.field(default_factory=list)  # kept when tracing
    # the trigger whose controller sees what comes next: the first pass of the prompt it retrieved for (``judge``), or
    # the segment re-predicted after its retrieval (``accepting``: kept unscored unless the controller says otherwise)
    judge: Any = None
    accepting: Any = None
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)  # a controller's own state of the row, by its name


class Decoder:
    """Runs rows' prompts and generates their segments with ``llm``, under ``steering`` (CtrlA's honesty vectors,
    active for every pass) and with ``probes`` ({key: probe}) attached; ``shared`` (or None) is the cache of sequences
    other loops over the same LLM and steering ran."""

    def __init__(
        self,
        llm: LLM,
        probes: dict[str, Any],
        steering: dict[int, torch.Tensor],
        shared: StateCache | None,
        batch_size: int,
        stop: tuple[str, ...],
        max_new_tokens: int,
    ):
        self.llm, self.probes, self.steering, self.batch_size = llm, probes, steering, batch_size
        self.stop, self.max_new_tokens = stop, max_new_tokens
        self.prefix = PrefixStore(llm, self._hooks, probes)
        # states other loops ran (under the same steering): reused unless a probe reads the values of every position
        self.shared = shared if not any(getattr(p, "reads_context", False) for p in probes.values()) else None
        self.eos = llm.eos_token_ids  # as the early set's greedy answer
        self.pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(self.eos or {0})

    @contextlib.contextmanager
    def _hooks(self):
        """Steering and probes on the LLM for one of the loop's own passes (never on a trigger's passes)."""
        from detectors.ctrla.steering import steer

        with torch.no_grad(), steer(self.llm.model, self.steering), contextlib.ExitStack() as stack:
            for probe in self.probes.values():
                stack.enter_context(probe)
            yield

    # ---- prompts -------------------------------------------------------------------------------------------
    def prefill(self, rows: list[Row]) -> None:
        """Run every row's prompt and kept tokens on the longest prefix already run (see the module's docstring);
        every sequence run is offered to the shared cache."""
        by_prompt: dict[tuple[int, ...], list] = {}
        on_states: list[tuple[Row, list[int], int, Any, dict[str, torch.Tensor] | None]] = []
        for row in rows:
            seq = row.prompt + row.kept
            primer = common_prefix(self.prefix.ids, seq)
            own = min(common_prefix(row.ran, seq), len(seq) - 1) if row.kv is not None else 0
            cached, kv = self.shared.lookup(seq) if self.shared is not None else (0, None)
            if own > primer and own >= cached:
                values = {key: torch.cat(v)[:own] for key, v in row.values.items()}
                on_states.append((row, seq, own, crop_states(row.kv, own), values))
            elif cached > primer:
                on_states.append((row, seq, cached, kv, None))  # a reused prefix's probe values are never read
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
        for idx in similar_lengths([len(seq) - p for _, seq, p, _, _ in on_states], self.batch_size):
            self._prefill_on_states([on_states[i] for i in idx])
        if self.shared is not None:
            for row in rows:
                self.shared.store(row.ran, row.kv)

    def _prefill_on_states(self, items: list[tuple[Row, list[int], int, Any, dict[str, torch.Tensor] | None]]) -> None:
        """One pass over each row's sequence after a prefix whose states it has (its own, or the shared cache's):
        the prefixes stacked left-padded, the rest right-padded (:func:`~detectors.llm.states.run_rows`)."""
        with self._hooks():
            seqs, prefixes = [seq for _, seq, _, _, _ in items], [(p, kv) for _, _, p, kv, _ in items]
            logits, states = run_rows(self.llm, seqs, prefixes, keep_states=True)
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
            row.kv = join_states(self.prefix.kv if shared else None, row_states(out.past_key_values, b, shared + pad))
            row.logits, row.ran = out.logits[b, -1], list(seq)
            row.values = {
                key: [self.prefix.values[key], v[b, pad:].clone()] if shared else [v[b, pad:].clone()]
                for key, v in values.items()
            }
            row.passes += 1 + (self.prefix.passes - passes)

    # ---- segments ------------------------------------------------------------------------------------------
    def decode(self, rows: list[Row]) -> None:
        """Every row generates its next segment: one batched pass per token, each row leaving at its own stop."""
        for row in rows:
            row.gen, row.prob, row.entropy, row.done = [], [], [], False
        batch, live = Lockstep(self.llm, [r.kv for r in rows]), list(rows)

        def leave(idx: list[int]) -> None:  # rows leave with a copy of their own states (to continue from, or to reuse)
            for i in idx:
                live[i].kv = batch.states(i)
            batch.drop(idx)
            for i in sorted(idx, reverse=True):
                del live[i]

        while live:
            leave([i for i, row in enumerate(live) if not self._choose(row)])
            if not live:
                break
            for row in live:
                row.ran.append(row.gen[-1])
            with self._hooks():
                logits = batch.step([r.gen[-1] for r in live], [len(r.ran) - 1 for r in live])  # each at its position
                values = {key: probe.take() for key, probe in self.probes.items()}
            for i, row in enumerate(live):
                row.logits = logits[i]
                row.passes += 1
                for key, v in values.items():
                    row.values[key].append(v[i])
            leave([i for i, row in enumerate(live) if self._segment_ends(row)])

    def _choose(self, row: Row) -> bool:
        """The row's next greedy token with its probability and entropy; False at the end of sequence (not kept)."""
        logp = torch.log_softmax(row.logits.float(), dim=-1)
        token = int(logp.argmax())
        if token in self.eos:
            row.done = True
            return False
        row.gen.append(token)
        row.prob.append(logp[token].exp())
        row.entropy.append(entropy(logp))
        row.generated += 1
        return True

    def _segment_ends(self, row: Row) -> bool:
        """After a token was run: whether the row's segment ends there (and the answer with it: ``row.done``)."""
        tok = self.llm.tokenizer
        if any(s in tok.decode(row.kept + row.gen, skip_special_tokens=True) for s in self.stop):
            # the token completing a stop string is not judged
            row.gen, row.prob, row.entropy = row.gen[:-1], row.prob[:-1], row.entropy[:-1]
            row.done = True
            return True
        if len(row.kept) + len(row.gen) >= self.max_new_tokens:
            row.done = True
            return True
        last = tok.decode(row.gen[-1:], skip_special_tokens=True).rstrip()
        return not row.whole and bool(_SENTENCE_END.search(last))

    def view(self, row: Row, lazy: dict[str, Calculator]) -> SegmentView:
        """The segment just generated, as triggers and queries see it: its tokens, their ``prob`` and ``entropy``,
        the probes' values over context + segment; ``lazy`` names who computes a statistic on demand."""
        context = row.prompt + row.kept
        n = len(context) + len(row.gen)
        probes = {key: torch.cat(chunks)[:n] for key, chunks in row.values.items()}

        def per_token(values: list[torch.Tensor]) -> np.ndarray:
            return torch.stack(values).cpu().numpy().astype(np.float64) if values else np.zeros(0)

        stats = {"prob": per_token(row.prob), "entropy": per_token(row.entropy)}
        text = self.llm.tokenizer.decode(row.gen, skip_special_tokens=True)
        return SegmentView(
            row.question, context, list(row.gen), text, stats, probes, row.question_stats, lazy, row.kv, len(row.prompt)
        )

    def final_text(self, ids: list[int]) -> str:
        """The answer: the kept tokens decoded, up to the first stop string."""
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop:
            text = text.split(s, 1)[0]
        return text.strip()
