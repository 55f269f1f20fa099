"""A dynamic RAG loop over any causal LM: triggers decide when to retrieve, a query formulation what to retrieve.

One question at a time, greedy decoding:

1. question triggers (DioR early detection, ``always``) may retrieve before anything is generated;
2. the LLM generates a segment (up to a sentence end, a stop string, end of sequence or the token budget) with a
   :class:`~detectors.dior.recorder.GenerationRecorder` attached (each token's probability, entropy and, for the
   real-time detector, its P(hallucination));
3. token triggers score the segment; the earliest one that fires cuts the generation (before the flagged token,
   or at the segment's start for FLARE and CtrlA), the query is formulated, passages are retrieved (replacing
   the previous ones, as DRAGIN does) and generation continues from the cut under the new prompt;
4. until the answer is complete; at most ``max_retrievals`` retrievals per question.

The prompt is the early set's prompt with the passages put right before the question, so the tokens before
the passages (a few-shot primer, a chat header) are shared by every question and every retrieval: the LLM's
key/value cache of the last sequence it ran is cropped to the longest common prefix and only the rest is run
(:class:`PrefixCache`). Without retrieval the answer is the early set's greedy answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from typing import Any

import numpy as np
import torch

from detectors.config.schema import PromptParams
from detectors.dior.recorder import GenerationRecorder
from detectors.llm.loading import LLM
from detectors.llm.words import DEFAULT_STOPWORDS, word_mask
from detectors.rag.context import render_passages, stepwise_retrieve
from detectors.rag.queries import DiorWeights, dior_query, flare_query, qfs_query
from detectors.rag.retriever import Hit, Retriever
from detectors.rag.triggers import CtrlATrigger, EarlyTrigger, FlareTrigger, RealtimeTrigger, Segment, Trigger

QUERIES = ("question", "flare", "qfs", "dior", "ctrla")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclasses.dataclass(frozen=True)
class RagConfig:
    """How one configuration of the loop generates, retrieves and formulates queries."""

    name: str
    prompt: PromptParams  # the no-retrieval prompt (``build_early.features.prompt``); must contain {question}
    context: str = "{passages}\n"  # put right before the question when passages were retrieved
    k: int = 3
    max_retrievals: int = 3
    max_new_tokens: int = 8
    stop: tuple[str, ...] = ("\n",)
    query: str = "question"  # question | flare | qfs | dior | ctrla
    stepwise: bool = False  # DioR post-retrieval: stepwise selection
    chunk: bool = False  # DioR post-retrieval: sentence-level chunking of the passages
    qfs_top_n: int = 8
    dior_top: int = 5
    dior_weights: DiorWeights = DiorWeights(0.25, 0.25, 0.25, 0.25)


@dataclasses.dataclass
class Retrieval:
    trigger: str  # which trigger fired
    position: int  # generated tokens kept before it (0 = before generating)
    score: float  # the trigger's score that fired
    queries: list[str]  # every query sent to the retriever for this retrieval
    passage_ids: list[str]
    passages: list[str]


@dataclasses.dataclass
class RagResult:
    question: str
    answer: str
    retrievals: list[Retrieval]
    forward_passes: int  # LLM forward passes: prefills, decoding steps, IG and teacher-forced passes of the triggers
    generated_tokens: int  # tokens generated, discarded ones included
    wall_s: float
    prompts: list[str]  # every prompt the LLM continued, in order (when recorded)
    error: str | None = None  # a recorded outcome, e.g. "no passage retrieved"


class PrefixCache:
    """The key/value cache of the last token sequence the LLM ran; the next sequence reuses their common prefix.

    With a ``monitor`` (CtrlA's confidence monitor) attached to every pass, ``projections`` holds its per-layer
    projections of every position of that sequence, cropped and extended with the cache."""

    def __init__(self, llm: LLM, monitor=None):
        self.llm, self.ids, self.cache, self.monitor = llm, [], None, monitor
        self.projections: torch.Tensor | None = None  # [len(ids), monitored layers]

    def run(self, ids: list[int]) -> torch.Tensor:
        """Logits ``[vocab]`` of the last position of ``ids``, running only what the cache does not hold."""
        common = 0
        limit = min(len(self.ids), len(ids) - 1)
        while common < limit and self.ids[common] == ids[common]:
            common += 1
        if common == 0:
            self.cache = None
        elif common < len(self.ids):
            self.cache.crop(common - len(self.ids))  # negative: drop that many positions from the end
        watch = self.monitor if self.monitor is not None else contextlib.nullcontext()
        if self.monitor is not None:
            self.monitor.reset()
        with torch.no_grad(), watch:
            out = self.llm.model(torch.tensor([ids[common:]], device=self.llm.device), past_key_values=self.cache, use_cache=True)
        if self.monitor is not None:
            new = self.monitor.layer_projections()[0]
            self.projections = torch.cat([self.projections[:common], new]) if common else new
        self.cache, self.ids = out.past_key_values, list(ids)
        return out.logits[0, -1]


class ForwardCounter:
    """Counts forward calls of a module while attached."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.calls, self._handle = model, 0, None

    def __enter__(self) -> "ForwardCounter":
        self._handle = self.model.register_forward_pre_hook(self._count)
        return self

    def _count(self, module, args) -> None:
        self.calls += 1

    def __exit__(self, *exc) -> None:
        self._handle.remove()


class RagLoop:
    """Answer questions with retrieval decided by ``triggers`` (checked in order) from ``retriever``.

    ``steering``: honesty steering vectors (CtrlA) active for every forward pass of generation.
    """

    def __init__(self, llm: LLM, retriever: Retriever | None, config: RagConfig, triggers: list[Trigger] = (),
                 steering: dict[int, torch.Tensor] | None = None, idf=None):  # fmt: skip
        if "{question}" not in config.prompt.template:
            raise ValueError(f"the RAG prompt template {config.prompt.template!r} has no {{question}}")
        if config.query not in QUERIES:
            raise ValueError(f"query formulation {config.query!r} is not one of {QUERIES}")
        if config.query == "ctrla" and not any(isinstance(t, CtrlATrigger) for t in triggers):
            raise ValueError(f"configuration {config.name!r}: CtrlA's masked query needs the ctrla-confidence trigger")
        if triggers and retriever is None:
            raise ValueError(f"configuration {config.name!r} has triggers but no retriever")
        self.llm, self.retriever, self.config, self.triggers = llm, retriever, config, list(triggers)
        self.steering, self.idf = steering, idf
        ctrla = [t for t in self.triggers if isinstance(t, CtrlATrigger)]
        self.cache = PrefixCache(llm, ctrla[0].monitor(llm) if ctrla else None)  # CtrlA reads the generation's own projections
        self.eos = llm.eos_token_ids  # as the early set's greedy answer
        realtime = [t for t in self.triggers if isinstance(t, RealtimeTrigger)]
        self.realtime = realtime[0].detector if realtime else None
        self.record_prompts = False
        self._generated, self._prompts = 0, []  # per question (reset by answer)

    # ---- prompts -------------------------------------------------------------------------------------------
    def prompt_ids(self, question: str, hits: list[Hit] | None, query: str) -> list[int]:
        """Token ids of the prompt, with the passages right before the question when there are any."""
        p = self.config.prompt
        if hits:
            block = self.config.context.replace("{passages}", render_passages(hits, self.config.chunk, query))
            p = dataclasses.replace(p, template=p.template.replace("{question}", block + "{question}", 1))
        text, _ = self.llm.render(question, p)
        if self.record_prompts:
            self._prompts.append(text)
        return self.llm.tokenizer(text, add_special_tokens=not p.chat)["input_ids"]

    # ---- generation ----------------------------------------------------------------------------------------
    def generate_segment(self, question: str, prompt: list[int], kept: list[int], whole: bool = False) -> tuple[Segment, bool]:
        """Greedy tokens after ``prompt + kept`` up to a sentence end (or only the answer's end when ``whole``);
        True when the answer is complete. Every generated token is run once, so each has its features."""
        indices = self.realtime.state_indices if self.realtime is not None else [-1]
        scorer = self.realtime.score_tokens if self.realtime is not None else None
        recorder = GenerationRecorder(self.llm.model, indices, scorer)
        context = prompt + kept
        gen: list[int] = []
        done = stopped = False
        with recorder, _steering(self.llm, self.steering):
            logits = self.cache.run(context)
            recorder(torch.tensor([context]), logits[None])
            while True:
                token = int(logits.argmax())
                if token in self.eos:
                    done = True
                    break
                gen.append(token)
                self._generated += 1
                logits = self.cache.run(context + gen)
                recorder(torch.tensor([context + gen]), logits[None])
                text = self.llm.tokenizer.decode(kept + gen, skip_special_tokens=True)
                if any(s in text for s in self.config.stop):
                    done, stopped = True, True  # the token that completes a stop string is not judged
                    break
                if len(kept) + len(gen) >= self.config.max_new_tokens:
                    done = True
                    break
                if not whole and _SENTENCE_END.search(self.llm.tokenizer.decode(gen[-1:], skip_special_tokens=True).rstrip()):
                    break
        trace = recorder.traces(set())[0] if gen else None
        if stopped:
            gen = gen[:-1]
            trace = dataclasses.replace(trace, gen_ids=gen, prob=trace.prob[:-1], entropy=trace.entropy[:-1],
                                        scores=None if trace.scores is None else trace.scores[:-1])  # fmt: skip
            if not gen:
                trace = None
        segment = Segment(
            question=question, prompt_ids=context, gen_ids=gen,
            prob=trace.prob.astype(np.float64) if trace else np.zeros(0),
            entropy=trace.entropy.astype(np.float64) if trace else np.zeros(0),
            text=self.llm.tokenizer.decode(gen, skip_special_tokens=True),
            mlp=trace.scores.astype(np.float64) if trace is not None and trace.scores is not None else None,
            confidence=None if self.cache.projections is None else self.cache.projections[: len(context) + len(gen)].cpu().numpy(),
        )  # fmt: skip
        return segment, done

    # ---- retrieval -----------------------------------------------------------------------------------------
    def formulate(self, question: str, kept: list[int], segment: Segment | None, cut: int, trigger: Trigger | None) -> str:
        c, tok = self.config, self.llm.tokenizer
        if c.query == "question" or segment is None and c.query in ("flare", "ctrla"):
            return question
        if c.query == "flare":
            theta = next((1 - t.threshold for t in self.triggers if isinstance(t, FlareTrigger)), 0.5)
            return flare_query(tok, question, segment.gen_ids, segment.prob, theta)
        if c.query == "ctrla":
            from detectors.ctrla.monitor import masked_query

            ctrla = next(t for t in self.triggers if isinstance(t, CtrlATrigger))
            return masked_query(tok, question, tok.decode(segment.prompt_ids, skip_special_tokens=True), segment.gen_ids, ctrla.eq2)
        generated = kept + (segment.gen_ids[: cut + 1] if segment is not None else [])
        context = tok(question, add_special_tokens=False)["input_ids"] + generated
        if c.query == "qfs":
            return qfs_query(self.llm, context, len(context) - 1, c.qfs_top_n, DEFAULT_STOPWORDS)
        return dior_query(self.llm, question, context, self._dior_candidates(question, kept, segment), c.dior_weights,
                          self.idf or (lambda w: 1.0), c.dior_top)  # fmt: skip

    def _dior_candidates(self, question: str, kept: list[int], segment: Segment | None) -> list[str]:
        """DioR §3.2: the early detector's IG keywords (Eq. 3) and the real-time detector's unflagged entity tokens;
        the question's content words when neither detector is attached."""
        out: list[str] = []
        for t in self.triggers:
            if isinstance(t, EarlyTrigger):
                out += t.keywords.get(question, [])
        if self.realtime is not None and segment is not None and segment.mlp is not None:
            out += self.realtime.keywords(segment.gen_ids, segment.mlp)
        if not out:
            ids = self.llm.tokenizer(question, add_special_tokens=False)["input_ids"]
            mask = word_mask(self.llm.tokenizer, ids)
            out = self.llm.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True).split()
        return list(dict.fromkeys(w for w in out if w.strip()))

    def retrieve(self, query: str) -> tuple[list[Hit], list[str]]:
        if self.config.stepwise:
            return stepwise_retrieve(self.retriever, query, self.config.k, self.idf)
        return self.retriever.search(query, self.config.k), [query]

    # ---- one question --------------------------------------------------------------------------------------
    def answer(self, question: str) -> RagResult:
        start = time.perf_counter()
        self._generated, self._prompts = 0, []
        retrievals: list[Retrieval] = []
        hits: list[Hit] | None = None
        query = question
        kept: list[int] = []
        replayed = 0.0
        with ForwardCounter(self.llm.model) as counter:
            for t in (t for t in self.triggers if t.stage == "question"):
                score = t.question_score(question)
                replayed += self._replayed(t, counter)
                if score >= t.threshold and len(retrievals) < self.config.max_retrievals:
                    query = self.formulate(question, kept, None, 0, t)
                    hits = self._retrieve_into(retrievals, t.name, 0, score, query)
                    break
            prompt = self.prompt_ids(question, hits, query)
            token_triggers = [t for t in self.triggers if t.stage == "token"]
            while True:
                segment, done = self.generate_segment(question, prompt, kept)
                fired = None
                if token_triggers and len(retrievals) < self.config.max_retrievals:
                    fired = self._first_firing(token_triggers, segment)
                if fired is None:
                    kept += segment.gen_ids
                    if done or not segment.gen_ids:
                        break
                    continue
                t, p, score = fired
                cut = p if t.truncate == "token" else 0
                query = self.formulate(question, kept, segment, p, t)
                kept += segment.gen_ids[:cut]
                hits = self._retrieve_into(retrievals, t.name, len(kept), score, query)
                prompt = self.prompt_ids(question, hits, query)
        error = "no passage retrieved" if retrievals and not any(r.passage_ids for r in retrievals) else None
        return RagResult(question, self._final_text(kept), retrievals, counter.calls, self._generated,
                         time.perf_counter() - start + replayed, list(self._prompts), error)  # fmt: skip

    @staticmethod
    def _replayed(trigger: Trigger, counter: "ForwardCounter") -> float:
        """Add the cost of a decision the trigger reused (see :class:`EarlyTrigger`) to the question's counters."""
        passes, seconds = getattr(trigger, "replayed", (0, 0.0))
        counter.calls += passes
        return seconds

    def _first_firing(self, triggers: list[Trigger], segment: Segment) -> tuple[Trigger, int, float] | None:
        best = None
        for t in triggers:
            scores = t.token_scores(self.llm, segment)
            p = t.first(scores)
            if p is None:
                continue
            cut = p if t.truncate == "token" else 0
            if best is None or cut < best[0]:
                best = (cut, t, p, float(scores[p]))
        return None if best is None else best[1:]

    def _retrieve_into(self, retrievals: list[Retrieval], trigger: str, position: int, score: float, query: str) -> list[Hit]:
        hits, queries = self.retrieve(query)
        retrievals.append(Retrieval(trigger, position, score, queries, [h.passage.id for h in hits], [h.passage.text for h in hits]))
        return hits

    def _final_text(self, ids: list[int]) -> str:
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.config.stop:
            text = text.split(s, 1)[0]
        return text.strip()


def _steering(llm: LLM, vectors: dict | None):
    from detectors.ctrla.steering import steer

    return steer(llm.model, vectors or {})


# ---- the accuracy vs retrieval-rate sweep: one retrieval at each trigger's first crossing -------------------


@dataclasses.dataclass
class QuestionTrace:
    """The no-retrieval answer with every trigger's scores (what a threshold sweep needs)."""

    question: str
    gen_ids: list[int]
    answer: str
    question_scores: dict[str, float]  # question triggers
    token_scores: dict[str, np.ndarray]  # token triggers, one score per generated token
    truncate: dict[str, str]  # token trigger -> "token" | "segment"
    forward_passes: int


def question_trace(loop: RagLoop, question: str) -> QuestionTrace:
    """Generate the no-retrieval answer as one segment and score it with every trigger of ``loop``."""
    loop._generated, loop._prompts = 0, []
    with ForwardCounter(loop.llm.model) as counter:
        q_scores = {t.name: float(t.question_score(question)) for t in loop.triggers if t.stage == "question"}
        prompt = loop.prompt_ids(question, None, question)
        segment, _ = loop.generate_segment(question, prompt, [], whole=True)
        t_scores = {t.name: np.asarray(t.token_scores(loop.llm, segment), dtype=np.float64) for t in loop.triggers if t.stage == "token"}
    truncate = {t.name: t.truncate for t in loop.triggers if t.stage == "token"}
    return QuestionTrace(question, segment.gen_ids, loop._final_text(segment.gen_ids), q_scores, t_scores, truncate, counter.calls)


def answer_after(loop: RagLoop, question: str, gen_ids: list[int], position: int, query: str) -> RagResult:
    """Keep the first ``position`` tokens of the no-retrieval answer ``gen_ids``, retrieve with ``query`` and
    finish the answer without further triggers."""
    start = time.perf_counter()
    loop._generated, loop._prompts = 0, []
    retrievals: list[Retrieval] = []
    kept = list(gen_ids[:position])
    with ForwardCounter(loop.llm.model) as counter:
        hits = loop._retrieve_into(retrievals, "sweep", position, float("nan"), query)
        prompt = loop.prompt_ids(question, hits, query)
        segment, _ = loop.generate_segment(question, prompt, kept, whole=True)
    kept += segment.gen_ids
    error = None if hits else "no passage retrieved"
    return RagResult(question, loop._final_text(kept), retrievals, counter.calls, loop._generated,
                     time.perf_counter() - start, list(loop._prompts), error)  # fmt: skip


def loop_info(loop: RagLoop) -> dict[str, Any]:
    """What a configuration is, for logs and MLflow tags."""
    c = loop.config
    return {"configuration": c.name, "triggers": ",".join(t.name for t in loop.triggers) or "none", "query": c.query,
            "stepwise": c.stepwise, "chunk": c.chunk, "k": c.k, "max_retrievals": c.max_retrievals}  # fmt: skip
