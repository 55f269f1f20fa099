"""RetroRAG (Xiao et al., "Retrieval-Augmented Generation by Evidence Retroactivity in LLMs") as a full RAG
configuration: the Answerer (§Answerer, Eq. 1) and the evidence-collation-and-discovery framework ELLERY (§Evidence
Collation and Discovery, Eq. 2-5), iterated per question as in the paper's Fig. 3, many questions at once.

Per question, iteration L = 0, 1, ... (at most ``max_iterations``):

1. **Evidence collation** (Eq. 2): retrieve ``k`` passages D_C with the search query q_s (q_s = q at L = 0), merge
   them with the stored source evidence E_s^(L-1), score every candidate with the evaluator M_e against the matching
   query q_m (q_m = q at L = 0, then ``q + " " + q_s``) and keep the ``top_n`` best as E_s^(L).
2. **Answerer** (Eq. 1): the answer-generator (M_C, greedy) writes the answer a and its reason r from the evidence
   E = E_s^(L) ∪ E_i^(L-1); the SC-generator (M_D, the same evidence, sampled at ``sc_temperature``) writes a_sc;
   the evaluator M_sc gives s_sc = P(yes) / (P(yes) + P(no)) that a and a_sc agree. s_sc > ``threshold``: the answer
   is a, the question is done.
3. **Evidence discovery** (Eq. 3-4): inferential evidence candidates e_ic are generated from E_s^(L) (M_IE, greedy),
   kept when both the Question-Relevance score (M_qr, against q_m) and the Reference-Attribution score (M_ra, against
   E_s^(L)) exceed ``gate`` (Eq. 3: 0.5), merged with E_i^(L-1), scored with M_e against the question q and the
   ``top_k_inferential`` best kept as E_i^(L) (Eq. 4).
4. **Re-query** (Eq. 5): the re-query generator (M_R, greedy) writes the next search query q_s from q, E_s^(L),
   E_i^(L) and the reason r.

A question that is never consistent gets the answer of its last iteration. Every evaluator is the paper's LLM-based
evaluator S: the next token's P(yes) / (P(yes) + P(no)) (:func:`yes_probability`).

**Adaptations at this scale** (SmolLM2-135M, a 2k-token budget per prompt, a bm25s index):

- greedy decoding stands for the paper's temperature 0.01 (answer-generator, M_IE, M_R); the SC-generator samples at
  ``sc_temperature`` (paper: 1.0) from one random stream per question and iteration (seeded by ``seed``, the question's
  text and the iteration; inverse-CDF sampling), so the samples are reproducible and independent of the batch size and
  of the other questions;
- retrieval is whatever the project's retriever is (BM25 top-``k`` here; the paper: BM25 or SimLM, top 5);
- the prompts are the appendix's (Figs. 7-13) shortened; the paper's few-shot CoT prompt M_C (after MetaRAG) is not
  given: M_C is the project's own question prompt (its few-shot primer) with the evidence and a one-line instruction
  put right before the question (as rag_eval puts its passages), so the answer is comparable with every other
  configuration. The answer is the first line of the greedy continuation, cut at ``answer_tokens`` tokens (as
  rag_eval's ``max_new_tokens`` and stop "\\n"); the continuation up to ``reason_tokens`` is the reason r (a 135M
  model writes no real chain of thought). The SC-generator's direct-answering prompt M_D is the same question prompt
  with its own evidence block; with no evidence
  (:func:`detectors.baselines.retrorag.self_consistency_scores`) it is the question prompt itself;
- every evidence item is shown truncated to ``evidence_words`` words, so that a prompt with ``top_n`` passages of
  ~100 words stays well under ~600 tokens;
- no key-entity extraction: M_IE's "entity" is the question; its first line, split at '#', gives the candidates;
  M_qr sees the candidate and q_m, as the appendix's Fig. 11 (not E_i^(L-1), which Eq. 3 also lists);
- the numbers are the paper's scaled to a 2-core CPU (``retrorag`` in params.yaml): k = top-N = top-K = 3 passages
  (rag_eval.k, the budget of every other configuration; paper: 5) and at most 3 iterations (paper: 5) — with a 135M
  evaluator s_sc rarely exceeds 0.7, so most questions run every iteration;
- no declarative assessor (the paper follows MetaRAG to standardise the answer's form).

Batching: the open questions advance together, iteration by iteration; every LLM call of a step is batched across
them (left-padded ``generate`` for the generators, :func:`yes_probability`'s right-padded passes on a cached shared
prefix for the evaluators), ``batch_size`` rows at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from detectors.config.retrorag import RetroRagParams
from detectors.config.schema import PromptParams
from detectors.llm.generate import Generation, generate, instruction_prompt, row_generator
from detectors.llm.judge import yes_no_ids, yes_probability
from detectors.llm.loading import LLM
from detectors.llm.prefill import KVCache
from detectors.rag.context import with_context
from detectors.rag.results import RagResult, Retrieval, charge, result
from detectors.rag.retriever import Hit

log = logging.getLogger(__name__)

TRIGGER = "retrorag"


# ---- evidence -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One piece of evidence: a retrieved passage (source evidence, ``id`` the passage's) or an inferred fact
    (inferential evidence, ``id`` ``ie:<digest of the text>``), with the evaluator's latest score."""

    id: str
    text: str
    score: float = float("nan")


def source_evidence(hit: Hit) -> Evidence:
    """A retrieved passage as source evidence: ``title: text`` (as rag_eval's prompts show passages)."""
    title = f"{hit.passage.title}: " if hit.passage.title else ""
    return Evidence(hit.passage.id, f"{title}{hit.passage.text}")


def inferred_evidence(text: str) -> Evidence:
    return Evidence("ie:" + hashlib.sha1(text.encode()).hexdigest()[:12], text)


def merge_evidence(stored: Sequence[Evidence], hits: Sequence[Hit]) -> list[Evidence]:
    """The candidates of evidence collation, E_s^(L-1) ∪ D_C^(L) (Eq. 2): the stored evidence, then every retrieved
    passage not stored already (by id), in rank order."""
    seen = {e.id for e in stored}
    out = list(stored)
    for hit in hits:
        if hit.passage.id not in seen:
            seen.add(hit.passage.id)
            out.append(source_evidence(hit))
    return out


def keep_top(candidates: Sequence[Evidence], scores: Sequence[float], n: int) -> list[Evidence]:
    """The ``n`` best-scored candidates, best first, each with its score (a tie keeps the earlier candidate first:
    stored evidence before new evidence). The top-N of Eq. 2 and the top-K of Eq. 4."""
    if len(candidates) != len(scores):
        raise ValueError(f"{len(candidates)} candidates but {len(scores)} scores")
    order = sorted(range(len(candidates)), key=lambda i: (-float(scores[i]), i))[:n]
    return [dataclasses.replace(candidates[i], score=float(scores[i])) for i in order]


def truncate_words(text: str, words: int) -> str:
    """``text`` cut to its first ``words`` words (an ellipsis marks the cut)."""
    parts = text.split()
    return " ".join(parts) if len(parts) <= words else " ".join(parts[:words]) + " ..."


def render_evidence(items: Sequence[Evidence], words: int, empty: str) -> str:
    """``[1] text`` lines, each truncated to ``words`` words; ``empty`` when there is none."""
    if not items:
        return empty
    return "\n".join(f"[{i}] {truncate_words(e.text, words)}" for i, e in enumerate(items, start=1))


def split_candidates(text: str) -> list[str]:
    """Inferential evidence candidates of an M_IE output: its first line split at '#', stripped, empty parts and
    repeats dropped."""
    out: list[str] = []
    for part in text.split("\n", 1)[0].split("#"):
        part = part.strip(" \t-*\"'")
        if len(part) > 1 and part not in out:
            out.append(part)
    return out


# ---- the procedure --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Iteration:
    """What one iteration of one question did (Fig. 3)."""

    search_query: str  # q_s^(L-1) (q at L = 0)
    matching_query: str  # q_m^(L) = q + " " + q_s^(L-1) (q at L = 0)
    retrieved: list[str]  # ids of D_C^(L)
    candidates: list[Evidence]  # E_s^(L-1) ∪ D_C^(L), each with its M_e score (Eq. 2)
    source: list[Evidence]  # E_s^(L): the top_n candidates
    evidence: list[Evidence] = dataclasses.field(default_factory=list)  # E = E_s^(L) ∪ E_i^(L-1): what the Answerer saw
    answer: str = ""  # a
    reason: str = ""  # r
    sc_answer: str = ""  # a_sc
    consistency: float = float("nan")  # s_sc (Eq. 1)
    # e_ic with s_qr and s_ra (Eq. 3)
    inferred: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)
    # E_i^(L) (Eq. 4; empty when discovery did not run)
    inferential: list[Evidence] = dataclasses.field(default_factory=list)
    next_query: str | None = None  # q_s^(L) (Eq. 5; None when the question stopped here)


@dataclasses.dataclass
class RetroState:
    """One question's state across iterations."""

    question: str
    record: bool = False
    search_query: str = ""
    matching_query: str = ""
    source: list[Evidence] = dataclasses.field(default_factory=list)  # E_s
    inferential: list[Evidence] = dataclasses.field(default_factory=list)  # E_i
    # M_e(e, q) of inferential evidence, by text (q is fixed)
    relevance: dict[str, float] = dataclasses.field(default_factory=dict)
    iterations: list[Iteration] = dataclasses.field(default_factory=list)
    retrievals: list[Retrieval] = dataclasses.field(default_factory=list)
    done: bool = False
    passes: int = 0
    generated: int = 0
    seconds: float = 0.0
    prompts: list[str] = dataclasses.field(default_factory=list)

    @property
    def answer(self) -> str:
        """The answer of the last iteration (the consistent one when the question stopped early)."""
        return self.iterations[-1].answer if self.iterations else ""

    def result(self) -> RagResult:
        return result(
            self.question, self.answer, self.retrievals, self.passes, self.generated, self.seconds, self.prompts
        )


class RetroRag:
    """RetroRAG over ``llm`` and ``retriever`` (``batch_search``), the Answerer's prompts built on the project's
    question prompt ``prompt``; ``batch_size`` rows per batched LLM call."""

    def __init__(
        self,
        llm: LLM,
        retriever,
        params: RetroRagParams,
        prompt: PromptParams,
        batch_size: int = 16,
        cache_bytes: int = 4 << 30,
    ):
        params.check("retrorag")
        prompt.check("prompt")
        if batch_size < 1:
            raise ValueError(f"RetroRAG: batch_size must be >= 1, got {batch_size}")
        self.llm, self.retriever, self.params, self.prompt, self.batch_size = llm, retriever, params, prompt, batch_size
        self.cache_bytes, self.cache = cache_bytes, None  # a KVCache while a group of questions runs
        self.yes_ids, self.no_ids = yes_no_ids(llm.tokenizer, params.yes_words, params.no_words)

    # ---- public API ----------------------------------------------------------------------------------------
    def answer_all(self, questions: Sequence[str], record_prompts: bool | Sequence[bool] = False) -> list[RagResult]:
        """Every question's RAG result (``record_prompts``: one flag, or one per question, keeps every prompt)."""
        return [s.result() for s in self.run(questions, record_prompts)]

    def run(self, questions: Sequence[str], record_prompts: bool | Sequence[bool] = False) -> list[RetroState]:
        """Every question through Fig. 3's iterations, ``batch_size`` questions together (the open ones of a group
        advance iteration by iteration, each LLM call batched across them); their states (every iteration kept).

        A group's prompts share one :class:`~detectors.llm.prefill.KVCache`: a prompt continues the longest prefix
        any earlier prompt of the group ran (evidence scored again against a new matching query, a reference shown to
        every candidate, the Answerer's prompt that grew by an evidence item), so each prefix runs once."""
        states = self.start(questions, record_prompts)
        for at in range(0, len(states), self.batch_size):
            self._run_group(states[at : at + self.batch_size])
        return states

    def _run_group(self, states: list[RetroState]) -> None:
        start = time.perf_counter()
        self.cache = KVCache(self.cache_bytes)
        p = self.params
        for level in range(p.max_iterations):
            active = [s for s in states if not s.done]
            log.info(
                "RetroRAG iteration %d/%d: %d of %d questions open",
                level + 1,
                p.max_iterations,
                len(active),
                len(states),
            )
            if not active:
                break
            last = level == p.max_iterations - 1
            self.collate(active)
            self.answerer(active, judge=not last)
            for s in active:
                s.done = last or s.iterations[-1].consistency > p.threshold
            rest = [s for s in active if not s.done]
            if rest:
                self.discover(rest)
                self.requery(rest)
        self.cache = None
        if states:  # the time outside the LLM's and the retriever's calls, shared evenly
            rest_s = max(time.perf_counter() - start - sum(s.seconds for s in states), 0.0)
            for s in states:
                s.seconds += rest_s / len(states)

    def start(self, questions: Sequence[str], record_prompts: bool | Sequence[bool] = False) -> list[RetroState]:
        """The initial states: q_s^(0) = q_m^(0) = q, no evidence."""
        flags = [record_prompts] * len(questions) if isinstance(record_prompts, bool) else list(record_prompts)
        if len(flags) != len(questions):
            raise ValueError(f"record_prompts has {len(flags)} flags for {len(questions)} questions")
        return [RetroState(q, bool(f), search_query=q, matching_query=q) for q, f in zip(questions, flags)]

    # ---- the steps (each on the open questions, every LLM call batched across them) ---------------------------
    def collate(self, states: list[RetroState]) -> None:
        """Evidence collation (Eq. 2): retrieve D_C with q_s, score E_s ∪ D_C with M_e against q_m, keep the top_n as
        E_s. Opens each question's next iteration; the retrieval is recorded, its score the s_sc that sent the question
        back (nan for the first)."""
        p = self.params
        start = time.perf_counter()
        found = self.retriever.batch_search([s.search_query for s in states], p.k)
        for s in states:
            s.seconds += (time.perf_counter() - start) / len(states)
        jobs, spans = [], []
        for s, hits in zip(states, found):
            previous = s.iterations[-1].consistency if s.iterations else float("nan")
            s.retrievals.append(Retrieval.of(TRIGGER, 0, previous, [s.search_query], hits))
            candidates = merge_evidence(s.source, hits)
            spans.append((len(jobs), candidates))
            jobs += [
                (
                    s,
                    self._instruction(
                        p.relevance_template.format(
                            evidence=truncate_words(e.text, p.evidence_words), question=s.matching_query
                        )
                    ),
                )
                for e in candidates
            ]
            s.iterations.append(Iteration(s.search_query, s.matching_query, [h.passage.id for h in hits], [], []))
        scores = self._score(jobs)
        for s, (at, candidates) in zip(states, spans):
            own = scores[at : at + len(candidates)]
            s.source = keep_top(candidates, own, p.top_n)
            s.iterations[-1].candidates = [dataclasses.replace(e, score=float(v)) for e, v in zip(candidates, own)]
            s.iterations[-1].source = list(s.source)

    def answerer(self, states: list[RetroState], judge: bool = True) -> None:
        """The Answerer (Eq. 1): a and r from the answer-generator (M_C, greedy), a_sc from the SC-generator (M_D,
        sampled), s_sc from M_sc on (q, a, a_sc); the evidence is E = E_s ∪ E_i. Without ``judge`` (the last
        iteration, whose answer stands whatever s_sc says) only a is generated: no reason, no a_sc, no s_sc."""
        p = self.params
        evidence = [self._evidence(s) for s in states]
        answer_prompts = [self._question_prompt(s.question, p.answer_context, e) for s, e in zip(states, evidence)]
        if judge:
            said = self._generate(list(zip(states, answer_prompts)), p.reason_tokens, stop=(), question_prompt=True)
        else:  # the answer is the continuation's first line, at most answer_tokens: the same tokens, without the reason
            said = self._generate(
                list(zip(states, answer_prompts)), p.answer_tokens, stop=("\n",), question_prompt=True
            )
        for s, e, g in zip(states, evidence, said):
            it = s.iterations[-1]
            it.evidence = e
            it.answer, it.reason = (
                self.answer_text(g.ids),
                " ".join(self.llm.tokenizer.decode(g.ids, skip_special_tokens=True).split()),
            )
        if not judge:
            return
        direct_prompts = [self._question_prompt(s.question, p.direct_context, e) for s, e in zip(states, evidence)]
        samples = self._generate(
            list(zip(states, direct_prompts)),
            p.answer_tokens,
            stop=("\n",),
            question_prompt=True,
            generators=[row_generator(p.seed, s.question, len(s.iterations) - 1) for s in states],
        )
        for s, sc in zip(states, samples):
            s.iterations[-1].sc_answer = sc.text
        jobs = [
            (
                s,
                self._instruction(
                    p.consistency_template.format(
                        question=s.question, answer=s.iterations[-1].answer, sc_answer=s.iterations[-1].sc_answer
                    )
                ),
            )
            for s in states
        ]
        for s, score in zip(states, self._score(jobs)):
            s.iterations[-1].consistency = float(score)

    def discover(self, states: list[RetroState]) -> None:
        """Evidence discovery (Eq. 3-4): candidates e_ic generated from the source evidence E_s (M_IE, greedy, one
        generation per question), kept when s_qr (M_qr, against q_m) and s_ra (M_ra, against E_s) both exceed
        ``gate``; merged with E_i, scored with M_e against q and the top_k_inferential kept as E_i."""
        p = self.params
        reference = {id(s): render_evidence(s.source, p.evidence_words, p.no_evidence) for s in states}
        jobs = [
            (s, self._instruction(p.inference_template.format(question=s.question, reference=reference[id(s)])))
            for s in states
        ]
        candidates: list[list[str]] = []
        for s, g in zip(states, self._generate(jobs, p.evidence_tokens, stop=("\n",))):
            known = {e.text for e in s.inferential}
            candidates.append([c for c in split_candidates(g.text) if c not in known])
        pairs = [(s, c) for s, cs in zip(states, candidates) for c in cs]
        qr = self._score(
            [
                (s, self._instruction(p.question_relevance_template.format(evidence=c, question=s.matching_query)))
                for s, c in pairs
            ]
        )
        ra = self._score(
            [
                (s, self._instruction(p.attribution_template.format(reference=reference[id(s)], evidence=c)))
                for s, c in pairs
            ]
        )
        gated: dict[int, list[Evidence]] = {id(s): [] for s in states}
        for (s, c), q_score, r_score in zip(pairs, qr, ra):
            s.iterations[-1].inferred.append((c, float(q_score), float(r_score)))
            if q_score > p.gate and r_score > p.gate:
                gated[id(s)].append(inferred_evidence(c))
        pools = {id(s): s.inferential + gated[id(s)] for s in states}
        fresh = [(s, e) for s in states for e in pools[id(s)] if e.text not in s.relevance]
        scores = self._score(
            [
                (s, self._instruction(p.relevance_template.format(evidence=e.text, question=s.question)))
                for s, e in fresh
            ]
        )
        for (s, e), score in zip(fresh, scores):
            s.relevance[e.text] = float(score)
        for s in states:
            pool = pools[id(s)]
            s.inferential = keep_top(pool, [s.relevance[e.text] for e in pool], p.top_k_inferential)
            s.iterations[-1].inferential = list(s.inferential)

    def requery(self, states: list[RetroState]) -> None:
        """The re-query generator (Eq. 5, M_R, greedy): q_s from q, E_s, E_i and the reason r; q_m = q + " " + q_s.
        An empty query falls back to the question."""
        p = self.params
        jobs = [
            (
                s,
                self._instruction(
                    p.requery_template.format(
                        question=s.question,
                        reference=render_evidence(s.source, p.evidence_words, p.no_evidence),
                        evidence=render_evidence(s.inferential, p.evidence_words, p.no_evidence),
                        reason=s.iterations[-1].reason,
                    )
                ),
            )
            for s in states
        ]
        for s, g in zip(states, self._generate(jobs, p.evidence_tokens, stop=("\n",))):
            query = g.text.strip().strip("\"'") or s.question
            s.iterations[-1].next_query = query
            s.search_query, s.matching_query = query, f"{s.question} {query}"

    # ---- helpers -------------------------------------------------------------------------------------------
    def answer_text(self, ids: list[int]) -> str:
        """The answer a: the first ``answer_tokens`` generated tokens, cut at the first newline (rag_eval's stop)."""
        return (
            self.llm.tokenizer.decode(ids[: self.params.answer_tokens], skip_special_tokens=True)
            .split("\n", 1)[0]
            .strip()
        )

    def _evidence(self, s: RetroState) -> list[Evidence]:
        """E = E_s ∪ E_i (source first; an inferred fact that repeats a source text is shown once)."""
        texts = {e.text for e in s.source}
        return list(s.source) + [e for e in s.inferential if e.text not in texts]

    def _question_prompt(self, question: str, context: str, evidence: list[Evidence]) -> str:
        """The project's question prompt with the evidence block ``context`` before the question (none without
        evidence)."""
        p = self.params
        block = context.format(evidence=render_evidence(evidence, p.evidence_words, p.no_evidence)) if evidence else ""
        return self.llm.render(question, with_context(self.prompt, block))[0]

    def _instruction(self, content: str) -> str:
        return instruction_prompt(self.llm, content, self.params.chat)

    def _record(self, jobs: list[tuple[RetroState, str]]) -> None:
        for s, text in jobs:
            if s.record:
                s.prompts.append(text)

    def _score(self, jobs: list[tuple[RetroState, str]]) -> np.ndarray:
        self._record(jobs)
        owners = [s for s, _ in jobs]
        return yes_probability(
            self.llm,
            [t for _, t in jobs],
            self.yes_ids,
            self.no_ids,
            self.batch_size,
            add_special_tokens=not self.params.chat,
            on_batch=charge(owners, share_seconds=True),
            cache=self.cache,
        )

    def _generate(
        self,
        jobs: list[tuple[RetroState, str]],
        max_new_tokens: int,
        stop: Sequence[str],
        question_prompt: bool = False,
        generators: list[torch.Generator] | None = None,
    ) -> list[Generation]:
        self._record(jobs)
        owners = [s for s, _ in jobs]
        chat = self.prompt.chat if question_prompt else self.params.chat
        out = generate(
            self.llm,
            [t for _, t in jobs],
            max_new_tokens,
            add_special_tokens=not chat,
            stop=stop,
            batch_size=self.batch_size,
            generators=generators,
            temperature=self.params.sc_temperature,
            on_batch=charge(owners, share_seconds=True),
            cache=self.cache,
        )
        for s, g in zip(owners, out):
            s.generated += len(g.ids)
        return out
