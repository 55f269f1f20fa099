"""A dynamic RAG loop over any causal LM, answering many questions at once: triggers decide when to retrieve, a
query formulation what to retrieve, the firing trigger's controller what the retrieval does.

For every question, greedy decoding:

1. question triggers (DioR early detection, ``always``) may retrieve before anything is generated;
2. the LLM generates a segment (up to a sentence end, a stop string, end of sequence or the token budget) while the
   loop measures every token (its probability and entropy, and what the triggers' probes record of the passes);
3. token triggers score the segment from those statistics; the earliest cut of those that fire wins, and its
   controller acts (:mod:`detectors.rag.controllers`; the plain one keeps the tokens before the flagged one, or none
   when the trigger regenerates its segment, formulates the query, retrieves: the passages replace the previous ones,
   as DRAGIN does, and generation continues from the cut under the new prompt);
4. until the answer is complete; at most ``max_retrievals`` retrievals per question.

The questions advance together in rounds (:mod:`detectors.rag.decoder`: prompts on the longest prefix already run,
segments in lockstep); the rows whose segment ended are scored together (a calculator's work is batched across them)
and the retrievals of a round go through ``batch_search``. A batch of one is the one-question-at-a-time loop: answers
and retrievals do not depend on the batch size (``tests/test_rag_loop.py``), and without retrieval the answer is the
early set's greedy answer.

Loops over the same LLM and steering share their decoding (:class:`~detectors.rag.decoder.Shared`): a segment is
decoded once for every loop that reaches the same prompt and kept tokens, and a calculator measures a segment once.
So a configuration whose triggers do not fire on a question answers it exactly as the no-retrieval reference does,
token for token, and the candidate thresholds of one configuration decode together until they part at a firing.

The loop knows no concrete trigger: a trigger is a scorer, a threshold, a policy and a controller with the calculators
of the statistics it reads (:mod:`detectors.rag.triggers`, :mod:`detectors.rag.stats`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from detectors.config.schema import PromptParams
from detectors.errors import InputError
from detectors.llm.loading import LLM
from detectors.rag.context import find_passages, render_passages, with_context
from detectors.rag.controllers import Fire
from detectors.rag.decoder import Decoder, Row, Shared, VllmDecoder
from detectors.rag.queries import QuestionQuery
from detectors.rag.results import RagResult, Retrieval, result
from detectors.rag.retriever import Hit, Retriever
from detectors.rag.stats import SegmentView, calculators_of, providers
from detectors.rag.triggers import Trigger


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


def on_engine(triggers: Sequence[Trigger]) -> tuple[dict[str, str], list[str]]:
    """How a loop with ``triggers`` runs on a serving engine (:class:`~detectors.rag.decoder.VllmDecoder`): the
    statistics the engine serves (``{statistic: "name@alias"}``: a registered detector's score of every token) and what
    the loop reads that the engine does not serve, empty when it can run there: the key/value cache (RIND), probes of
    the loop's passes (hidden states, attention: a calculator's the engine does not serve, a controller's), a second
    served detector (a request carries one)."""
    calculators = calculators_of(triggers)
    served = {c.provides[0]: c.served for c in calculators if c.served}
    blockers = [f"{c.key} (the key/value cache)" for c in calculators if c.reads_kv]
    blockers += [c.key for c in calculators if c.probe is not None and not c.served]
    blockers += [key for t in triggers for key in t.controller.probes()]
    blockers += [f"{stat} (a second served detector)" for stat in list(served)[1:]]
    return served, blockers


def _grouped(items: list, controller) -> list[tuple[Any, list]]:
    """``items`` grouped by the controller ``controller(item)`` returns (by identity), in order of appearance."""
    groups: dict[int, tuple[Any, list]] = {}
    for item in items:
        c = controller(item)
        groups.setdefault(id(c), (c, []))[1].append(item)
    return list(groups.values())


class RagLoop:
    """Answer questions with retrieval decided by ``triggers`` (checked in order) from ``retriever``, the query
    formulated by ``query`` (default: the question).

    ``steering``: honesty steering vectors (CtrlA) active for every forward pass of generation; with ``engine``, the
    registered steering's ``name@alias``, which the engine applies. ``shared``: what the loops over the same LLM and
    steering ran (:class:`~detectors.rag.decoder.Shared`: their states, segments and measurements; a segment another
    loop decoded is taken, not decoded again). ``probes``: more probes on every pass ({key: probe}, beside those of the
    triggers' calculators and controllers; with ``engine``, more served detectors ``{statistic: "name@alias"}``), so
    that other loops reading them can take its segments. A ``reference`` loop reads nothing others ran (its answers
    depend on its own questions only) and keeps its segments for every loop until ``shared`` is cleared: the
    no-retrieval and always-retrieve decodings every other loop of a shard of questions branches from. ``engine``: a
    ``vllm.LLM`` on the same checkpoint (with this package's plugin) that generates the segments instead of the shared
    decoder (:class:`~detectors.rag.decoder.VllmDecoder`: for triggers that read token probabilities and entropies, or
    one registered detector's score the engine computes: DioR's real-time MLP, CtrlA's confidence).

    Controllers act through :meth:`retrieve`, :meth:`set_prompt` and :meth:`keep`.
    """

    def __init__(
        self,
        llm: LLM,
        retriever: Retriever | None,
        config: RagConfig,
        triggers: Sequence[Trigger] = (),
        query=None,
        steering: dict[int, torch.Tensor] | str | None = None,
        shared: Shared | None = None,
        probes: dict[str, Any] | None = None,
        reference: bool = False,
        engine: Any = None,
    ):
        name = config.name
        if "{question}" not in config.prompt.template:
            raise ValueError(f"the RAG prompt template {config.prompt.template!r} has no {{question}}")
        if triggers and retriever is None:
            raise ValueError(f"configuration {name!r} has triggers but no retriever")
        if config.batch_size < 1:
            raise ValueError(f"configuration {name!r}: batch_size must be >= 1, got {config.batch_size}")
        self.llm, self.retriever, self.config, self.triggers = llm, retriever, config, list(triggers)
        self.query = query if query is not None else QuestionQuery()
        self.calculators = calculators_of(self.triggers)
        provided = providers(self.calculators)
        needs = [(n, f"trigger {t.name!r}") for t in self.triggers for n in t.needs]
        for need, what in needs + [(n, f"query {self.query.name!r}") for n in self.query.needs]:
            if need not in provided:
                raise ValueError(
                    f"configuration {name!r}: {what} needs the statistic {need!r}, which none of its triggers measures"
                )
        self.lazy = {name: c for c in self.calculators for name in c.lazy}
        if isinstance(steering, str) and engine is None:
            raise ValueError(
                f"configuration {name!r}: steering {steering!r} names a registered steering, which a serving engine "
                "applies: give this package's decoder its vectors (the detector's vectors())"
            )
        self.shared = shared
        args = (shared, config.batch_size, tuple(config.stop), config.max_new_tokens, reference)
        if engine is None:
            own = {c.key: c.probe for c in self.calculators if c.probe is not None}
            for t in self.triggers:
                own.update(t.controller.probes())
            self.decoder: Decoder = Decoder(llm, {**(probes or {}), **own}, steering or {}, *args)
        else:
            served, blockers = on_engine(self.triggers)
            if blockers:
                raise InputError(
                    f"configuration {name!r} reads {blockers}, which a serving engine does not serve (it serves each "
                    "token's probability and entropy, one registered detector's score and a registered steering): run "
                    "it on the Hugging Face engine (no engine=)"
                )
            self.decoder = VllmDecoder(engine, {**(probes or {}), **served}, llm, {}, steering, *args)

    # ---- public API ----------------------------------------------------------------------------------------
    def answer(self, question: str, record_prompts: bool = False) -> RagResult:
        """One question (a batch of one)."""
        return self.answer_all([question], record_prompts)[0]

    def answer_all(self, questions: Sequence[str], record_prompts: bool | Sequence[bool] = False) -> list[RagResult]:
        """Every question, ``config.batch_size`` at a time; ``record_prompts`` (one flag, or one per question) keeps
        every prompt the LLM continued. A question that cannot be answered (an unusable question for the early
        detector) comes back with its error; the others are answered. A loop none of whose triggers can fire
        (:attr:`can_fire`) measures nothing for them: it answers as no retrieval does, at its cost."""
        flags = [record_prompts] * len(questions) if isinstance(record_prompts, bool) else list(record_prompts)
        rows = [Row(q, record=f) for q, f in zip(questions, flags)]
        return self._in_batches(rows, observe=False, triggers=self.can_fire)

    @property
    def can_fire(self) -> bool:
        """Whether a trigger can fire: one below +inf (a score fires at or above its threshold, and every scorer's
        scores are finite but where a policy forces a firing, which +inf cannot stop: CtrlA's refusal)."""
        return any(t.threshold < math.inf or t.policy.forced for t in self.triggers)

    def trace(self, questions: Sequence[str]) -> list[QuestionTrace]:
        """The no-retrieval answer of each question (decoded as every answer is, segment by segment: the segments the
        no-retrieval reference decoded), scored as one segment by every trigger (none fires)."""
        rows = [Row(q) for q in questions]
        results = self._in_batches(rows, observe=True)
        token_triggers = [t for t in self.triggers if t.stage == "token"]
        cuts = {t.name: t.policy.cut for t in token_triggers}
        views = [self._whole(row) for row in rows]
        scored = [v for v in views if v is not None and v.gen_ids]  # an empty answer has no token to score
        if scored and token_triggers:
            self._measure(scored)
        out = []
        for row, res, view in zip(rows, results, views):
            stats = view.stats if view is not None else {}  # none when the question could not be answered
            token = {
                t.name: t.token_scores(stats) if view is not None and view.gen_ids else np.zeros(0)
                for t in token_triggers
            }
            question = {
                t.name: row.question_scores.get(t.name, float("nan")) for t in self.triggers if t.stage == "question"
            }
            out.append(
                QuestionTrace(
                    row.question, list(row.kept), res.answer, question, token, cuts, res.forward_passes, stats
                )
            )
        return out

    def _whole(self, row: Row) -> SegmentView | None:
        """A traced answer's segments as one segment after the prompt (None for a question that could not be
        answered)."""
        if not row.segments:
            return None
        last = row.segments[-1]
        stats = {k: np.concatenate([s.stats[k] for s in row.segments]) for k in ("prob", "entropy")}
        text = self.llm.tokenizer.decode(row.kept, skip_special_tokens=True)
        return SegmentView(
            row.question,
            list(row.prompt),
            list(row.kept),
            text,
            stats,
            last.probes,
            row.question_stats,
            self.lazy,
            last.kv,
            len(row.prompt),
        )

    def answer_after(self, jobs: Sequence[tuple[str, list[int], int, str]]) -> list[RagResult]:
        """For each ``(question, gen_ids, position, query)``: keep the first ``position`` tokens of the answer
        ``gen_ids``, retrieve with ``query`` and finish the answer, without triggers."""
        rows = [Row(q, kept=list(gen[:p]), query=query) for q, gen, p, query in jobs]
        return self._in_batches(rows, observe=False, triggers=False)

    def final_text(self, ids: list[int]) -> str:
        """The answer: the kept tokens decoded, up to the first stop string."""
        return self.decoder.final_text(ids)

    # ---- rounds --------------------------------------------------------------------------------------------
    def _in_batches(self, rows: list[Row], observe: bool, triggers: bool = True) -> list[RagResult]:
        out = []
        for start in range(0, len(rows), self.config.batch_size):
            batch = rows[start : start + self.config.batch_size]
            began = time.perf_counter()
            self._run(batch, observe, triggers)
            share = (time.perf_counter() - began) / len(batch)
            for r in batch:
                answer = self.final_text(r.kept) if r.error is None else ""
                out.append(
                    result(
                        r.question, answer, r.retrievals, r.passes, r.generated, share + r.seconds, r.prompts, r.error
                    )
                )
        return out

    def _run(self, rows: list[Row], observe: bool, triggers: bool) -> None:
        active = self._question_stage(rows, observe, triggers)
        while active:
            self.decoder.prefill([r for r in active if r.logits is None])
            judged = [r for r in active if r.judge is not None]
            for controller, group in _grouped(judged, lambda r: r.judge.controller):
                for r in group:
                    r.judge = None
                self.decoder.prefill(controller.prompt_ran(self, group))
            self.decoder.decode(active)
            self._after_segment(active, observe, triggers)
            active = [r for r in active if not r.finished]

    def _question_stage(self, rows: list[Row], observe: bool, triggers: bool) -> list[Row]:
        """Question triggers in order, then every row's first prompt; returns the rows that go on."""
        forced = [r for r in rows if r.query is not None]
        if forced:
            self.retrieve(forced, [r.query for r in forced], "sweep", [float("nan")] * len(forced))
        if triggers:
            for calc in (c for c in self.calculators if c.question):
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
                room = self.config.max_retrievals
                fire = [Fire(r, trigger, None, 0, float(s)) for r, s in zip(open_, scores) if s >= trigger.threshold]
                fire = [f for f in fire if not observe and len(f.row.retrievals) < room]
                if fire:
                    trigger.controller.fired(self, fire)
        active = [r for r in rows if not r.finished]
        for row in active:
            if not row.retrievals:
                self.set_prompt(row, None, row.question)
        return active

    def _after_segment(self, rows: list[Row], observe: bool, triggers: bool) -> None:
        """Score the segments that ended, and hand each to the controller of the trigger concerned: the one that fired
        on it, or the one whose retrieval it was re-predicted after; the others are kept."""
        views = [self.decoder.view(row, self.lazy) for row in rows]
        token_triggers = [t for t in self.triggers if t.stage == "token"] if triggers else []
        room = self.config.max_retrievals
        scored = [
            bool(token_triggers and view.gen_ids)
            and row.accepting is None
            and not observe
            and len(row.retrievals) < room
            for row, view in zip(rows, views)
        ]
        if any(scored):
            self._measure([v for v, s in zip(views, scored) if s])
        fires: list[Fire] = []
        repredicted: list[tuple[Row, SegmentView, Trigger]] = []
        for row, view, score in zip(rows, views, scored):
            if observe:
                row.segments.append(view)
            if row.accepting is not None:
                repredicted.append((row, view, row.accepting))
                row.accepting = None
                continue
            fired = self._first_firing(token_triggers, view) if score else None
            if fired is None:
                self.keep(row, view)
            else:
                fires.append(Fire(row, fired[0], view, fired[1], fired[2]))
        for controller, group in _grouped(repredicted, lambda item: item[2].controller):
            controller.repredicted(self, group)
        for controller, group in _grouped(fires, lambda f: f.trigger.controller):
            controller.fired(self, group)

    def _measure(self, views: list[SegmentView]) -> None:
        """Every calculator's statistics of the views: measured once per segment for every loop that shares this one's
        decoding."""
        for calc in self.calculators:
            todo = [v for v in views if not all(name in v.stats for name in calc.provides)]  # not served already
            if not todo:
                continue
            if self.shared is None:
                calc.segments(todo)
            else:
                self.shared.measure(calc, todo)

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

    # ---- what controllers do -------------------------------------------------------------------------------
    def keep(self, row: Row, view: SegmentView) -> None:
        """The segment stays in the answer; the row is finished when the answer is complete."""
        row.kept += row.gen
        row.gen = []
        row.begin()
        if row.done or not view.gen_ids:
            row.finished = True
            row.kv, row.logits, row.values = None, None, {}

    def retrieve(self, rows: list[Row], queries: list[str], triggers: str | list[str], scores: list[float]) -> None:
        """One retrieval for each row (``batch_search``; stepwise selection per row), recorded in its trace; the
        passages go in its prompt."""
        names = [triggers] * len(rows) if isinstance(triggers, str) else triggers
        found = find_passages(self.retriever, list(queries), self.config.k, self.config.stepwise)
        for row, name, score, query, (hits, issued) in zip(rows, names, scores, queries, found):
            row.retrievals.append(Retrieval.of(name, len(row.kept), score, issued, hits))
            self.set_prompt(row, hits, query)

    def set_prompt(self, row: Row, hits: list[Hit] | None, query: str, context: str | None = None) -> None:
        """The row's prompt, with the passages ``hits`` (retrieved with ``query``) right before the question in
        ``context`` (default: the configuration's; ``{passages}`` marks them); it must run again."""
        p = self.config.prompt
        if hits:
            block = (context or self.config.context).replace(
                "{passages}", render_passages(hits, self.config.chunk, query)
            )
            p = with_context(p, block)
        text, _ = self.llm.render(row.question, p)
        if row.record:
            row.prompts.append(text)
        row.prompt = self.llm.tokenizer(text, add_special_tokens=not p.chat)["input_ids"]
        row.begin()
        row.logits = None  # its states of what it ran so far stay: the new prompt may begin as the old one did


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
