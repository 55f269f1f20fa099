"""A dynamic RAG loop over any causal LM, answering many questions at once: triggers decide when to retrieve, a
query formulation what to retrieve.

For every question, greedy decoding:

1. question triggers (DioR early detection, ``always``) may retrieve before anything is generated;
2. the LLM generates a segment (up to a sentence end, a stop string, end of sequence or the token budget) while the
   loop measures every token (its probability and entropy, and what the triggers' probes record of the passes);
3. token triggers score the segment from those statistics; the earliest cut of those that fire wins (the tokens
   before the flagged one stay, or none when the trigger regenerates its segment), the query is formulated,
   passages are retrieved (replacing the previous ones, as DRAGIN does) and generation continues from the cut
   under the new prompt;
4. until the answer is complete; at most ``max_retrievals`` retrievals per question.

**Many questions at once.** The questions advance together in rounds: the rows that need a prompt run it on the
longest prefix already run (their own earlier prompt when a retrieval returned the same first passages; a prompt
several rows continue; the few-shot primer, cached once and kept between batches), in left-padded batches of
similar length (a prompt's pass is arithmetic-bound: padding costs, batching buys nothing), then every row generates its next segment in lockstep, one batched pass per token, each row leaving the batch at
its own stop; the rows whose segment ended are scored together (a calculator's work is batched across them), the
retrievals of a round go through ``batch_search``, and rows that retrieved rejoin the next round with their new
prompt. A batch of one is the one-question-at-a-time loop: answers and retrievals do not depend on the batch size
(``tests/test_rag_loop.py``), and without retrieval the answer is the early set's greedy answer.

The loop knows no concrete trigger: a trigger is a scorer, a threshold and a policy with the calculators of the
statistics it reads (:mod:`detectors.rag.triggers`, :mod:`detectors.rag.stats`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from detectors.config.schema import PromptParams
from detectors.evaluation.answer_metrics import FAILED
from detectors.llm.distribution import entropy
from detectors.llm.kv import PrefixStore, as_cache, common_prefix, crop_states, join_states, row_states
from detectors.llm.loading import LLM
from detectors.llm.states import Lockstep, StateCache, run_rows, similar_lengths
from detectors.rag.context import render_passages, stepwise_retrieve, with_context
from detectors.rag.queries import QueryInput, QuestionQuery
from detectors.rag.retriever import Hit, Retriever
from detectors.rag.stats import SegmentView, calculators_of, providers
from detectors.rag.triggers import Trigger

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclasses.dataclass(frozen=True)
class RagConfig:
    """How one configuration of the loop generates and retrieves."""

    name: str
    prompt: PromptParams  # the no-retrieval prompt (``build_early.features.prompt``); must contain {question}
    context: str = "{passages}\n"  # put right before the question when passages were retrieved
    k: int = 3
    max_retrievals: int = 3
    max_new_tokens: int = 8
    stop: tuple[str, ...] = ("\n",)
    stepwise: bool = False  # DioR post-retrieval: stepwise selection
    chunk: bool = False  # DioR post-retrieval: sentence-level chunking of the passages
    batch_size: int = 32  # questions advanced together (rows per batched pass)


@dataclasses.dataclass
class Retrieval:
    trigger: str  # which trigger fired
    position: int  # generated tokens kept before it (0 = before generating)
    score: float  # the trigger's score that fired
    queries: list[str]  # every query sent to the retriever for this retrieval
    passage_ids: list[str]
    passages: list[str]
    scores: list[float] = dataclasses.field(default_factory=list)  # the retriever's score of each passage
    used: bool = True  # False: the trigger's gate judged the passages and answered without them
    gate_score: float | None = None  # the gate's score (None: no gate)


@dataclasses.dataclass
class PostRetrieval:
    """What a gate sees of a question once its passages are in the prompt, before any answer token: the question's
    early-set columns, the LLM's first-token distribution with the passages (the early set's ``first_token_*``
    statistics, measured on the new prompt), the hidden state of the prompt's last token at the gate's layers (its
    probe) and the retriever's scores."""

    question: str
    question_stats: dict[str, Any]
    first_token_prob: float
    first_token_entropy: float
    first_token_margin: float
    hidden: np.ndarray | None
    retrieval_scores: list[float]


@dataclasses.dataclass
class RagResult:
    question: str
    answer: str
    retrievals: list[Retrieval]
    forward_passes: int  # LLM forward passes the question took part in (its own, its batches', its triggers')
    generated_tokens: int  # tokens generated, discarded ones included
    wall_s: float  # its share of the batch's time, plus the cost of measurements reused from another configuration
    prompts: list[str]  # every prompt the LLM continued, in order (when recorded)
    error: str | None = None  # a recorded outcome, e.g. "no passage retrieved"


@dataclasses.dataclass
class QuestionTrace:
    """The no-retrieval answer with every trigger's scores (what a threshold sweep needs)."""

    question: str
    gen_ids: list[int]
    answer: str
    question_scores: dict[str, float]  # question triggers
    token_scores: dict[str, np.ndarray]  # token triggers, one score per generated token
    truncate: dict[str, str]  # token trigger -> its cut ("token" | "segment")
    forward_passes: int
    stats: dict[str, Any]  # the answer's per-token statistics (what the triggers' scorers read)


@dataclasses.dataclass
class _Row:
    """One question's state in the loop."""

    question: str
    record: bool = False
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
    values: dict[str, list[torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )  # probe values per position of ``ran``, in chunks
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
    gate: Any = None  # the gate that judges the passages just retrieved, once their prompt has run
    accepting: Trigger | None = None  # the next segment re-predicts one after this trigger's retrieval: kept unscored
    attempts: int = 0  # refusal-handling retrievals for the segment being re-predicted


class RagLoop:
    """Answer questions with retrieval decided by ``triggers`` (checked in order) from ``retriever``, the query
    formulated by ``query`` (default: the question).

    ``steering``: honesty steering vectors (CtrlA) active for every forward pass of generation. ``shared``: a
    :class:`~detectors.llm.states.StateCache` of the sequences loops over the same LLM and steering ran (a prompt
    another configuration ran is not run again).
    """

    def __init__(
        self,
        llm: LLM,
        retriever: Retriever | None,
        config: RagConfig,
        triggers: Sequence[Trigger] = (),
        query=None,
        steering: dict[int, torch.Tensor] | None = None,
        shared: StateCache | None = None,
    ):
        if "{question}" not in config.prompt.template:
            raise ValueError(f"the RAG prompt template {config.prompt.template!r} has no {{question}}")
        if triggers and retriever is None:
            raise ValueError(f"configuration {config.name!r} has triggers but no retriever")
        if config.batch_size < 1:
            raise ValueError(f"configuration {config.name!r}: batch_size must be >= 1, got {config.batch_size}")
        self.llm, self.retriever, self.config, self.triggers = llm, retriever, config, list(triggers)
        self.query = query if query is not None else QuestionQuery()
        self.steering = steering or {}
        self.calculators = calculators_of(self.triggers)
        provided = providers(self.calculators)
        for need, what in [(n, f"trigger {t.name!r}") for t in self.triggers for n in t.needs] + [
            (n, f"query {self.query.name!r}") for n in self.query.needs
        ]:
            if need not in provided:
                raise ValueError(
                    f"configuration {config.name!r}: {what} needs the statistic {need!r}, which none of its triggers measures"
                )
        self.lazy = {name: c for c in self.calculators for name in c.lazy}
        self.probes = {c.key: c.probe for c in self.calculators if c.probe is not None}
        self.probes.update(
            {t.gate.key: t.gate.probe for t in self.triggers if t.gate is not None and t.gate.probe is not None}
        )
        self.prefix = PrefixStore(llm, self._hooks, self.probes)
        # states other loops ran (under the same steering): reused unless a probe reads the values of every position
        self.shared = shared if not any(getattr(p, "reads_context", False) for p in self.probes.values()) else None
        self.eos = llm.eos_token_ids  # as the early set's greedy answer
        self.pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else min(self.eos or {0})

    # ---- public API ----------------------------------------------------------------------------------------
    def answer(self, question: str, record_prompts: bool = False) -> RagResult:
        """One question (a batch of one)."""
        return self.answer_all([question], record_prompts)[0]

    def answer_all(self, questions: Sequence[str], record_prompts: bool | Sequence[bool] = False) -> list[RagResult]:
        """Every question, ``config.batch_size`` at a time; ``record_prompts`` (one flag, or one per question) keeps
        every prompt the LLM continued. A question that cannot be answered (an unusable question for the early
        detector) comes back with its error; the others are answered."""
        flags = [record_prompts] * len(questions) if isinstance(record_prompts, bool) else list(record_prompts)
        return self._in_batches([_Row(q, record=f) for q, f in zip(questions, flags)], observe=False)

    def trace(self, questions: Sequence[str]) -> list[QuestionTrace]:
        """The no-retrieval answer of each question as one segment, scored by every trigger (none fires)."""
        rows = [_Row(q, whole=True) for q in questions]
        results = self._in_batches(rows, observe=True)
        out = []
        for row, result in zip(rows, results):
            stats = row.segments[0].stats if row.segments else {}  # none when the question could not be answered
            scored = len(row.kept) > 0  # an empty answer has no token to score
            token = {
                t.name: t.token_scores(stats) if scored else np.zeros(0) for t in self.triggers if t.stage == "token"
            }
            question = {
                t.name: row.question_scores.get(t.name, float("nan")) for t in self.triggers if t.stage == "question"
            }
            out.append(
                QuestionTrace(
                    row.question,
                    list(row.kept),
                    result.answer,
                    question,
                    token,
                    {t.name: t.policy.cut for t in self.triggers if t.stage == "token"},
                    result.forward_passes,
                    stats,
                )
            )
        return out

    def answer_after(self, jobs: Sequence[tuple[str, list[int], int, str]]) -> list[RagResult]:
        """For each ``(question, gen_ids, position, query)``: keep the first ``position`` tokens of the answer
        ``gen_ids``, retrieve with ``query`` and finish the answer as one segment, without triggers."""
        rows = [_Row(q, kept=list(gen[:p]), query=query, whole=True) for q, gen, p, query in jobs]
        return self._in_batches(rows, observe=False, triggers=False)

    # ---- rounds --------------------------------------------------------------------------------------------
    def _in_batches(self, rows: list[_Row], observe: bool, triggers: bool = True) -> list[RagResult]:
        out = []
        for start in range(0, len(rows), self.config.batch_size):
            batch = rows[start : start + self.config.batch_size]
            began = time.perf_counter()
            self._run(batch, observe, triggers)
            share = (time.perf_counter() - began) / len(batch)
            out += [self._result(row, share) for row in batch]
        return out

    def _run(self, rows: list[_Row], observe: bool, triggers: bool) -> None:
        active = self._question_stage(rows, observe, triggers)
        while active:
            self._prefill([r for r in active if r.logits is None])
            self._prefill(self._gate([r for r in active if r.gate is not None]))
            self._decode(active)
            self._after_segment(active, observe, triggers)
            active = [r for r in active if not r.finished]

    def _question_stage(self, rows: list[_Row], observe: bool, triggers: bool) -> list[_Row]:
        """Question triggers in order, then every row's first prompt; returns the rows that go on."""
        forced = [r for r in rows if r.query is not None]
        if forced:
            self._retrieve(forced, [r.query for r in forced], "sweep", [float("nan")] * len(forced))
        if triggers:
            for calc in self.calculators:
                if not calc.question:
                    continue
                for row, measured in zip(rows, calc.questions([r.question for r in rows])):
                    row.passes += measured.passes
                    row.seconds += 0.0 if measured.fresh else measured.seconds
                    if isinstance(measured.value, Exception):
                        row.error, row.finished = f"{type(measured.value).__name__}: {measured.value}", True
                    else:
                        row.question_stats.update(measured.value)
            for trigger in (t for t in self.triggers if t.stage == "question"):
                open_ = [r for r in rows if not r.finished and r.query is None and (observe or not r.retrievals)]
                if not open_:
                    break
                scores = trigger.question_scores([r.question_stats for r in open_])
                for row, score in zip(open_, scores):
                    row.question_scores[trigger.name] = float(score)
                fire = [
                    (r, float(s))
                    for r, s in zip(open_, scores)
                    if not observe and s >= trigger.threshold and len(r.retrievals) < self.config.max_retrievals
                ]
                if fire:
                    queries = self.query.formulate_all(
                        self.llm, [QueryInput(r.question, r.kept, question_stats=r.question_stats) for r, _ in fire]
                    )
                    self._retrieve([r for r, _ in fire], queries, trigger.name, [s for _, s in fire])
                    for row, _ in fire:
                        row.gate = trigger.gate
        active = [r for r in rows if not r.finished]
        for row in active:
            if not row.retrievals:
                self._set_prompt(row, None, row.question)
        return active

    # ---- forward passes ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _hooks(self):
        """Steering and probes on the LLM for one of the loop's own passes (never on a trigger's passes)."""
        from detectors.ctrla.steering import steer

        with torch.no_grad(), steer(self.llm.model, self.steering), contextlib.ExitStack() as stack:
            for probe in self.probes.values():
                stack.enter_context(probe)
            yield

    def _prefill(self, rows: list[_Row]) -> None:
        """Run every row's prompt and kept tokens on the longest prefix already run: its own previous sequence (a new
        retrieval that returned the same first passages), a sequence another configuration ran (the shared
        :class:`~detectors.llm.states.StateCache`), or the prefix rows share (a prompt that several rows continue, or
        the few-shot primer, cached once); in batches of similar length, so that little is padding (a prompt's pass is
        arithmetic-bound: batching buys little there, padding costs). Every sequence run is offered to the shared
        cache."""
        by_prompt: dict[tuple[int, ...], list] = {}
        on_states: list[tuple[_Row, list[int], int, Any, dict[str, torch.Tensor] | None]] = []
        for row in rows:
            seq = row.prompt + row.kept
            primer = common_prefix(self.prefix.ids, seq)
            own = min(common_prefix(row.ran, seq), len(seq) - 1) if row.kv is not None else 0
            cached, kv = self.shared.lookup(seq) if self.shared is not None else (0, None)
            if own > primer and own >= cached:
                on_states.append(
                    (
                        row,
                        seq,
                        own,
                        crop_states(row.kv, own),
                        {key: torch.cat(v)[:own] for key, v in row.values.items()},
                    )
                )
            elif cached > primer:
                on_states.append(
                    (row, seq, cached, kv, None)
                )  # the probes' values of a reused prefix are never read (no probe reads_context)
            else:
                by_prompt.setdefault(tuple(row.prompt), []).append((row, seq))
        # rows with the same prompt (the sweep's retrievals at several positions of one answer) run it once, as their
        # shared prefix; the others in batches of similar length
        same = [group for group in by_prompt.values() if len(group) > 1]
        alone = [group[0] for group in by_prompt.values() if len(group) == 1]
        for group in same:
            for start in range(0, len(group), self.config.batch_size):
                self._prefill_chunk(group[start : start + self.config.batch_size])
        for idx in similar_lengths([len(seq) for _, seq in alone], self.config.batch_size):
            self._prefill_chunk([alone[i] for i in idx])
        for idx in similar_lengths([len(seq) - p for _, seq, p, _, _ in on_states], self.config.batch_size):
            self._prefill_on_states([on_states[i] for i in idx])
        if self.shared is not None:
            for row in rows:
                self.shared.store(row.ran, row.kv)

    def _prefill_on_states(self, items: list[tuple[_Row, list[int], int, Any, dict[str, torch.Tensor] | None]]) -> None:
        """One pass over each row's sequence after a prefix whose states it has (its own, or the shared cache's):
        the prefixes stacked left-padded, the rest right-padded (:func:`~detectors.llm.states.run_rows`)."""
        with self._hooks():
            logits, states = run_rows(
                self.llm, [seq for _, seq, _, _, _ in items], [(p, kv) for _, _, p, kv, _ in items], keep_states=True
            )
            values = {key: probe.take() for key, probe in self.probes.items()}
        for b, (row, seq, p, _, before) in enumerate(items):
            row.kv, row.logits, row.ran = states[b], logits[b], list(seq)
            new = {key: v[b, : len(seq) - p].clone() for key, v in values.items()}
            row.values = {
                key: [before[key] if before is not None else v.new_zeros(p, v.shape[-1]), v] for key, v in new.items()
            }
            row.passes += 1

    def _prefill_chunk(self, chunk: list[tuple[_Row, list[int]]]) -> None:
        """One left-padded pass over the rows' sequences after the prefix they share (kept in the prefix store)."""
        seqs = [seq for _, seq in chunk]
        passes = self.prefix.passes
        shared = self.prefix.get(seqs)
        rests = [s[shared:] for s in seqs]
        width = max(len(r) for r in rests)
        pads = [width - len(r) for r in rests]
        ids = torch.tensor([[self.pad] * p + r for p, r in zip(pads, rests)], device=self.llm.device)
        mask = torch.tensor(
            [[1] * shared + [0] * p + [1] * len(r) for p, r in zip(pads, rests)], device=self.llm.device
        )
        positions = torch.tensor([[shared + max(i - p, 0) for i in range(width)] for p in pads], device=self.llm.device)
        with self._hooks():
            out = self.llm.model(
                ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                past_key_values=as_cache(self.prefix.kv, len(chunk), self.llm.model.config) if shared else None,
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

    def _decode(self, rows: list[_Row]) -> None:
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
                logits = batch.step(
                    [r.gen[-1] for r in live], [len(r.ran) - 1 for r in live]
                )  # each fed token at its own position
                values = {key: probe.take() for key, probe in self.probes.items()}
            for i, row in enumerate(live):
                row.logits = logits[i]
                row.passes += 1
                for key, v in values.items():
                    row.values[key].append(v[i])
            leave([i for i, row in enumerate(live) if self._segment_ends(row)])

    def _choose(self, row: _Row) -> bool:
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

    def _segment_ends(self, row: _Row) -> bool:
        """After a token was run: whether the row's segment ends there (and the answer with it: ``row.done``)."""
        tok = self.llm.tokenizer
        if any(s in tok.decode(row.kept + row.gen, skip_special_tokens=True) for s in self.config.stop):
            row.gen, row.prob, row.entropy = (
                row.gen[:-1],
                row.prob[:-1],
                row.entropy[:-1],
            )  # the token completing a stop string is not judged
            row.done = True
            return True
        if len(row.kept) + len(row.gen) >= self.config.max_new_tokens:
            row.done = True
            return True
        return not row.whole and bool(_SENTENCE_END.search(tok.decode(row.gen[-1:], skip_special_tokens=True).rstrip()))

    def _gate(self, rows: list[_Row]) -> list[_Row]:
        """Each row's gate judges the passages its question trigger just retrieved, from what their prompt's pass
        gave (:class:`PostRetrieval`); a row whose passages it rejects goes back to the prompt without them (returned:
        it must run that prompt)."""
        rejected = []
        by_gate: dict[int, list[_Row]] = {}
        for row in rows:
            by_gate.setdefault(id(row.gate), []).append(row)
        for group in by_gate.values():
            gate = group[0].gate
            items = []
            for row in group:
                logp = torch.log_softmax(row.logits.float(), dim=-1)
                top2 = torch.topk(logp.exp(), 2)
                hidden = (
                    torch.cat(row.values[gate.key])[len(row.ran) - 1].float().cpu().numpy()
                    if gate.probe is not None
                    else None
                )
                items.append(
                    PostRetrieval(
                        row.question,
                        row.question_stats,
                        float(top2.values[0]),
                        float(entropy(logp)),
                        float(top2.values[0] - top2.values[1]),
                        hidden,
                        row.retrievals[-1].scores,
                    )
                )
            for row, score in zip(group, gate.judge(items)):
                retrieval, row.gate = row.retrievals[-1], None
                retrieval.gate_score = float(score)
                if score < gate.threshold:
                    retrieval.used = False
                    self._set_prompt(row, None, row.question)
                    rejected.append(row)
        return rejected

    # ---- after a segment -----------------------------------------------------------------------------------
    def _after_segment(self, rows: list[_Row], observe: bool, triggers: bool) -> None:
        tok = self.llm.tokenizer
        views = []
        for row in rows:
            context = row.prompt + row.kept
            n = len(context) + len(row.gen)
            probes = {key: torch.cat(chunks)[:n] for key, chunks in row.values.items()}
            stats = {
                "prob": torch.stack(row.prob).cpu().numpy().astype(np.float64) if row.gen else np.zeros(0),
                "entropy": torch.stack(row.entropy).cpu().numpy().astype(np.float64) if row.gen else np.zeros(0),
            }
            views.append(
                SegmentView(
                    row.question,
                    context,
                    list(row.gen),
                    tok.decode(row.gen, skip_special_tokens=True),
                    stats,
                    probes,
                    row.question_stats,
                    self.lazy,
                    row.kv,
                    len(row.prompt),
                )
            )
        token_triggers = [t for t in self.triggers if t.stage == "token"] if triggers else []
        scored = [
            bool(token_triggers and view.gen_ids)
            and row.accepting is None
            and (observe or len(row.retrievals) < self.config.max_retrievals)
            for row, view in zip(rows, views)
        ]
        if any(scored):
            for calc in self.calculators:
                calc.segments([v for v, s in zip(views, scored) if s])
        fires: list[tuple[_Row, SegmentView, Trigger, int, float]] = []
        refused: list[tuple[_Row, Trigger]] = []
        for row, view, score in zip(rows, views, scored):
            if observe:
                row.segments.append(view)
            if row.accepting is not None:  # re-predicted after its trigger's retrieval
                trigger, row.accepting = row.accepting, None
                if self._still_refuses(row, view, trigger):
                    refused.append((row, trigger))
                    continue
                row.attempts = 0
                self._keep_segment(row, view)
                if trigger.policy.passages == "segment" and not row.finished:
                    self._set_prompt(row, None, row.question)  # the next segment from (x, y<t): CtrlA's Alg. 1, line 4
                continue
            fired = self._first_firing(token_triggers, view) if score and not observe else None
            if fired is None:
                self._keep_segment(row, view)
            else:
                row.accepting = fired[0] if fired[0].policy.after_retrieval == "accept" else None
                fires.append((row, view, *fired))
        if refused:
            self._handle_refusals(refused)
        validated = [f for f in fires if f[2].validator is not None]
        fires = [f for f in fires if f[2].validator is None]
        if fires:
            queries = self.query.formulate_all(
                self.llm, [QueryInput(r.question, r.kept, v, p, r.question_stats) for r, v, _, p, _ in fires]
            )
            for row, _, trigger, p, _ in fires:
                row.kept += row.gen[: trigger.cut_at(p)]
                row.gen = []
            self._retrieve([f[0] for f in fires], queries, [f[2].name for f in fires], [f[4] for f in fires])
        if validated:
            self._validate(validated)

    def _keep_segment(self, row: _Row, view: SegmentView) -> None:
        """The segment stays in the answer; the row is finished when the answer is complete."""
        row.kept += row.gen
        row.gen = []
        if row.done or not view.gen_ids:
            row.finished = True
            row.kv, row.logits, row.values = None, None, {}

    def _validate(self, fires: list[tuple[_Row, SegmentView, Trigger, int, float]]) -> None:
        """Stitch-in-Time (§2.1.3-2.2) for the rows whose validating trigger fired: their uncertain concepts (each
        entity at or above the threshold, most uncertain first) are validated one after another, within
        ``max_retrievals``: the concept's validation question is the query, and the trigger's validator answers it
        from the passages. The first concept that fails repairs the segment: it is generated again with those
        passages in the prompt and kept (the trigger's policy accepts it). A segment whose every concept passes
        stays as it was, and the passages are not used (recorded with ``used=False`` and the validator's P(yes))."""
        tok = self.llm.tokenizer
        queue = []
        for row, view, trigger, _, _ in fires:
            scores = trigger.token_scores(view.stats)
            spans = {
                int(idx[0]): idx for idx in view.stats[trigger.scorer.spans] if len(idx)
            }  # an entity-level scorer's concepts
            order = [
                i for i in np.argsort(-scores, kind="stable") if scores[i] >= trigger.threshold and int(i) in spans
            ]
            room = self.config.max_retrievals - len(row.retrievals)
            concepts = [
                (float(scores[i]), tok.decode([view.gen_ids[j] for j in spans[int(i)]], skip_special_tokens=True))
                for i in order
            ][:room]
            if concepts:
                queue.append((row, view, trigger, concepts))
        while queue:
            jobs = [(row, view, trigger, concepts.pop(0)) for row, view, trigger, concepts in queue]
            questions = [t.validator.question(r.question, v.text, concept) for r, v, t, (_, concept) in jobs]
            found = self.retriever.batch_search(questions, self.config.k)
            by_validator: dict[int, list[int]] = {}
            for j, (_, _, trigger, _) in enumerate(jobs):
                by_validator.setdefault(id(trigger.validator), []).append(j)
            verdict = np.zeros(len(jobs))
            for idx in by_validator.values():
                validator = jobs[idx[0]][2].validator
                verdict[idx] = validator.judge(
                    [questions[j] for j in idx],
                    [render_passages(found[j], False, questions[j]) for j in idx],
                    on_batch=self._charge([jobs[j][0] for j in idx]),
                )
            for (row, _, trigger, (score, _)), question, hits, p_yes in zip(jobs, questions, found, verdict):
                row.retrievals.append(
                    Retrieval(
                        trigger.name,
                        len(row.kept),
                        score,
                        [question],
                        [h.passage.id for h in hits],
                        [h.passage.text for h in hits],
                        [float(h.score) for h in hits],
                        used=False,
                        gate_score=float(p_yes),
                    )
                )
                if p_yes < trigger.validator.threshold:  # a hallucinated concept: repair the sentence with the evidence
                    row.retrievals[-1].used = True
                    row.gen = []
                    self._set_prompt(row, hits, question)
            queue = [(r, v, t, c) for r, v, t, c in queue if r.gen and c]
        for row, _view, *_ in fires:
            if row.gen:  # every concept passed: the segment stays
                row.accepting = None
                self._keep_segment(row, view)

    def _still_refuses(self, row: _Row, view: SegmentView, trigger: Trigger) -> bool:
        """Whether a segment re-predicted after ``trigger``'s retrieval goes to its refusal handling (CtrlA's Alg. 3,
        lines 9-11): it refuses (f_d), and attempts and retrievals are left."""
        handler = trigger.refusal
        return (
            handler is not None
            and handler.refuses(view.text)
            and row.attempts < handler.max_attempts
            and len(row.retrievals) < self.config.max_retrievals
        )

    def _handle_refusals(self, refused: list[tuple[_Row, Trigger]]) -> None:
        """CtrlA's refusal handling H_R (Alg. 2) for segments that still refuse after their trigger's retrieval: the
        previous query is rewritten (f_QR), the passages it retrieves replace the old ones and the segment is
        re-predicted (kept unless it refuses again, up to the handler's ``max_attempts``). The retrieval is recorded as
        ``<trigger>:refusal`` with score +inf (the refusal detector's)."""
        by_handler: dict[int, list[tuple[_Row, Trigger]]] = {}
        for row, trigger in refused:
            by_handler.setdefault(id(trigger.refusal), []).append((row, trigger))
        for group in by_handler.values():
            rows = [row for row, _ in group]
            handler = group[0][1].refusal

            queries = handler.rewrite(
                [r.question for r in rows], [r.retrievals[-1].queries[-1] for r in rows], on_batch=self._charge(rows)
            )
            for row, trigger in group:
                row.gen, row.attempts, row.accepting = [], row.attempts + 1, trigger
            self._retrieve(rows, queries, [f"{t.name}:refusal" for _, t in group], [float("inf")] * len(rows))

    @staticmethod
    def _charge(rows: list[_Row]):
        """An ``on_batch`` callback that counts a batched call's forward passes for each of its rows (the loop's own
        rule: a batched pass counts for every question in it)."""

        def charge(idx: list[int], calls: int, seconds: float) -> None:
            for i in idx:
                rows[i].passes += calls

        return charge

    @staticmethod
    def _first_firing(triggers: list[Trigger], view: SegmentView) -> tuple[Trigger, int, float] | None:
        """The trigger whose firing keeps the fewest tokens (the first one listed on a tie), where, and its score."""
        best = None
        for t in triggers:
            scores = t.token_scores(view.stats)
            p = t.first(scores)
            if p is not None and (best is None or t.cut_at(p) < best[0]):
                best = (t.cut_at(p), t, p, float(scores[p]))
        return None if best is None else best[1:]

    # ---- retrieval and prompts -----------------------------------------------------------------------------
    def _retrieve(self, rows: list[_Row], queries: list[str], triggers: str | list[str], scores: list[float]) -> None:
        """One retrieval for each row (``batch_search``; stepwise selection per row), recorded in its trace."""
        names = [triggers] * len(rows) if isinstance(triggers, str) else triggers
        c = self.config
        if c.stepwise:
            found = [stepwise_retrieve(self.retriever, q, c.k, getattr(self.retriever, "idf", None)) for q in queries]
        else:
            found = [(hits, [q]) for hits, q in zip(self.retriever.batch_search(list(queries), c.k), queries)]
        for row, name, score, query, (hits, issued) in zip(rows, names, scores, queries, found):
            row.retrievals.append(
                Retrieval(
                    name,
                    len(row.kept),
                    score,
                    issued,
                    [h.passage.id for h in hits],
                    [h.passage.text for h in hits],
                    [float(h.score) for h in hits],
                )
            )
            self._set_prompt(row, hits, query)

    def _set_prompt(self, row: _Row, hits: list[Hit] | None, query: str) -> None:
        """The row's prompt, with the passages ``hits`` (retrieved with ``query``) right before the question; it
        must run again."""
        p = self.config.prompt
        if hits:
            p = with_context(
                p, self.config.context.replace("{passages}", render_passages(hits, self.config.chunk, query))
            )
        text, _ = self.llm.render(row.question, p)
        if row.record:
            row.prompts.append(text)
        row.prompt = self.llm.tokenizer(text, add_special_tokens=not p.chat)["input_ids"]
        row.logits = None  # its states of what it ran so far stay: the new prompt may begin as the old one did

    # ---- results -------------------------------------------------------------------------------------------
    def _result(self, row: _Row, share: float) -> RagResult:
        if row.error is not None:
            return RagResult(
                row.question,
                "",
                row.retrievals,
                row.passes,
                row.generated,
                share + row.seconds,
                row.prompts,
                f"{FAILED} {row.error}",
            )
        error = "no passage retrieved" if row.retrievals and not any(r.passage_ids for r in row.retrievals) else None
        return RagResult(
            row.question,
            self.final_text(row.kept),
            row.retrievals,
            row.passes,
            row.generated,
            share + row.seconds,
            row.prompts,
            error,
        )

    def final_text(self, ids: list[int]) -> str:
        """The answer: the kept tokens decoded, up to the first stop string."""
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.config.stop:
            text = text.split(s, 1)[0]
        return text.strip()


def loop_info(loop: RagLoop) -> dict[str, Any]:
    """What a configuration is, for logs and MLflow tags."""
    c = loop.config
    return {
        "configuration": c.name,
        "triggers": ",".join(t.name for t in loop.triggers) or "none",
        "query": loop.query.name,
        "stepwise": c.stepwise,
        "chunk": c.chunk,
        "k": c.k,
        "max_retrievals": c.max_retrievals,
    }
