"""What the RAG loop measures while the LLM generates, under the names and meanings of the stored sets.

A generated segment's ``stats`` hold one value per generated token: ``prob`` and ``entropy`` (always: the
distribution each token was chosen from), and what the triggers' calculators add: ``mlp`` (the real-time
detector's P(hallucination)), ``rind`` (DRAGIN), ``ctrla_confidence`` (CtrlA's -Eq. 2) and ``entities`` (the token
indices of each spaCy entity), the per-token statistics of the real-time set (:mod:`detectors.evaluation.units`).
A question's ``question_stats`` are the early set's columns (:func:`detectors.dior.early.features_to_row`). So a
scorer (:mod:`detectors.evaluation.scorers`, :mod:`detectors.baselines`) computes the same score from a stored set
offline and from the generation online: one definition of each score.

A :class:`Calculator` provides some of these statistics for a batch of segments (or questions) at once. It may
ask the loop for a *probe* (``key``, a context manager attaching hooks, ``take() -> [B, T, d]``): the loop runs its
forward passes with the probe attached and keeps what it recorded at every position of every row, so hidden
states (:class:`~detectors.llm.layers.StateTap`) and CtrlA's projections
(:class:`~detectors.ctrla.monitor.ConfidenceMonitor`) come from the generation itself, never from a second pass.
"""

from __future__ import annotations

import dataclasses
import json
import time
import weakref
from typing import Any

import numpy as np
import torch

from detectors.errors import RecordError
from detectors.llm.kv import ForwardCounter
from detectors.llm.loading import LLM


@dataclasses.dataclass
class SegmentView:
    """One generated segment as the triggers and query formulations see it."""

    question: str
    context_ids: list[int]  # everything before the segment: the prompt (passages, question) and the kept answer tokens
    gen_ids: list[int]
    text: str  # the segment decoded
    stats: dict[str, Any]  # per generated token (see the module's docstring)
    probes: dict[str, torch.Tensor]  # calculator key -> its probe's values at every position of context + segment, [len, d]
    question_stats: dict[str, Any]
    providers: dict[str, "Calculator"] = dataclasses.field(default_factory=dict)  # who computes a lazy statistic
    states: Any = None  # the LLM's key/value states of context + segment (what the loop ran), for calculators that run more
    answer_start: int | None = None  # where the kept answer tokens begin in ``context_ids`` (None: no answer kept yet)

    def stat(self, name: str, default: Any = None) -> Any:
        """Statistic ``name``, computed now by its calculator when it is a lazy one (e.g. the keywords of a query)."""
        if name not in self.stats and name in self.providers:
            self.stats[name] = self.providers[name].lazy_stat(name, self)
        return self.stats.get(name, default)

    def at_segment(self, key: str) -> torch.Tensor:
        """A calculator's probe values at the segment's own tokens ``[len(gen_ids), d]``."""
        n = len(self.context_ids)
        return self.probes[key][n : n + len(self.gen_ids)]

    @property
    def kept_ids(self) -> list[int]:
        """The answer tokens kept before the segment (CtrlA's preceding generation y<t)."""
        return [] if self.answer_start is None else self.context_ids[self.answer_start :]


@dataclasses.dataclass
class Measured:
    """A question's statistics (or the error that makes the question unusable) and what computing them cost;
    ``fresh`` is False when they were computed earlier (for another configuration) and reused."""

    value: dict[str, Any] | Exception
    passes: int
    seconds: float
    fresh: bool


class Calculator:
    """Provides statistics: ``provides`` of every segment, ``lazy`` ones of a segment on demand, ``question`` ones of
    every question. Triggers that need the same statistics share one calculator (same ``key``)."""

    key: str = ""
    provides: tuple[str, ...] = ()
    lazy: tuple[str, ...] = ()
    question: tuple[str, ...] = ()
    probe: Any = None  # attached to the loop's forward passes; its values are kept under the calculator's key

    def segments(self, views: list[SegmentView]) -> None:
        """Add the ``provides`` statistics to each view's ``stats`` (every view holds at least one token)."""

    def lazy_stat(self, name: str, view: SegmentView) -> Any:
        raise KeyError(name)

    def questions(self, questions: list[str]) -> list[Measured]:
        return []


class MlpCalculator(Calculator):
    """``mlp``: the real-time detector's P(hallucination) of each generated token, from the hidden states the loop's
    own passes produced (its probe) and the token's probability and entropy, computed by the detector's
    serving function (:meth:`~detectors.dior.realtime_detector.RealtimeDetector.score_tokens`); lazily
    ``keywords``: the entity tokens of the generated text it does not flag (DioR §3.2, §3.3.1)."""

    key, provides, lazy = "mlp", ("mlp",), ("keywords",)

    def __init__(self, detector):
        from detectors.llm.layers import StateTap

        self.detector = detector
        self.probe = StateTap(detector.llm.model, detector.state_indices)

    def segments(self, views: list[SegmentView]) -> None:
        hidden = torch.cat([v.at_segment(self.key) for v in views])
        prob = torch.from_numpy(np.concatenate([v.stats["prob"] for v in views]).astype(np.float32))
        entropy = torch.from_numpy(np.concatenate([v.stats["entropy"] for v in views]).astype(np.float32))
        device = hidden.device
        scores = self.detector.score_tokens(hidden, prob.to(device), entropy.to(device)).reshape(-1).float().cpu().numpy()
        for v, part in zip(views, np.split(scores.astype(np.float64), np.cumsum([len(v.gen_ids) for v in views])[:-1])):
            v.stats["mlp"] = part

    def lazy_stat(self, name: str, view: SegmentView) -> Any:
        """DioR §3.3.1 reads the entire generated text: the kept answer tokens (none flagged, or the trigger would have
        cut there) and the scored segment (asked of a segment that fired)."""
        kept = view.kept_ids
        return self.detector.keywords(kept + view.gen_ids, np.concatenate([np.zeros(len(kept)), view.stats["mlp"]]))


class RindCalculator(Calculator):
    """``rind``: DRAGIN's RIND of each generated token (:func:`~detectors.baselines.rind.rind_on_states`): the segments
    run once more, in one eager batch, on the loop's cached states of their contexts, with the entropies the loop
    recorded (the real-time set's RIND, :func:`~detectors.baselines.rind.rind_scores`, teacher-forces the whole
    sequence; the values are the same)."""

    key, provides = "rind", ("rind",)

    def __init__(self, llm: LLM, stopwords: frozenset[str]):
        self.llm, self.stopwords = llm, stopwords

    def segments(self, views: list[SegmentView]) -> None:
        from detectors.baselines.rind import rind_on_states
        from detectors.llm.kv import crop_states

        contexts = [crop_states(v.states, len(v.context_ids)) for v in views]
        traces = rind_on_states(self.llm, contexts, [v.gen_ids for v in views], [v.stats["entropy"] for v in views], self.stopwords)
        for v, trace in zip(views, traces):
            v.stats["rind"] = trace.rind


class EntityCalculator(Calculator):
    """``entities``: the token indices of each spaCy entity of the segment (the real-time set's entity tokens,
    :func:`~detectors.dior.entities.entity_tokens`)."""

    key, provides = "entities", ("entities",)

    def __init__(self, llm: LLM, nlp):
        self.llm, self.nlp = llm, nlp

    def segments(self, views: list[SegmentView]) -> None:
        from detectors.dior.entities import entity_tokens, token_offsets

        for v, doc in zip(views, self.nlp.pipe([v.text for v in views])):
            offsets = token_offsets(self.llm, v.gen_ids)
            spans = [entity_tokens(offsets, ent.start_char, ent.end_char) for ent in doc.ents]
            v.stats["entities"] = [np.asarray(s, dtype=np.int64) for s in spans if s]


class CtrlACalculator(Calculator):
    """CtrlA's monitor on the generation itself (its probe: the projections of every position at the
    detector's layers, under whatever steering the loop runs): ``ctrla_eq2`` (Eq. 2 of each generated token over the
    running sequence), ``ctrla_confidence`` (its negation, the real-time set's CtrlA score), ``new_content`` (the
    tokens of new non-stopword words, the only ones CtrlA's trigger reads) and ``refusal`` (App. B.3.1)."""

    key, provides = "ctrla", ("ctrla_eq2", "ctrla_confidence", "new_content", "refusal")

    def __init__(self, detector):
        from detectors.ctrla.monitor import ConfidenceMonitor

        self.detector, self.params = detector, detector.params
        self.probe = ConfidenceMonitor(detector.llm.model, detector.directions)

    def segments(self, views: list[SegmentView]) -> None:
        from detectors.ctrla.monitor import detect_refusal, pooled_scores
        from detectors.llm.words import content_mask

        tok = self.detector.llm.tokenizer
        for v in views:  # the probe's values cover exactly context + segment
            eq2 = pooled_scores(v.probes[self.key].cpu().numpy(), self.params.tau, self.params.clip)[len(v.context_ids) :].astype(np.float64)
            v.stats["ctrla_eq2"], v.stats["ctrla_confidence"] = eq2, -eq2
            # new: not in the question q or the preceding generation y<t (Eq. 3's w ∉ q ∪ y<t), whatever else the prompt shows
            context = f"{v.question} {tok.decode(v.kept_ids, skip_special_tokens=True)}"
            v.stats["new_content"] = np.asarray(content_mask(tok, context, v.gen_ids), dtype=bool)
            v.stats["refusal"] = bool(detect_refusal(v.text, list(self.params.refusal_patterns)))


class EarlyCalculator(Calculator):
    """The early set's columns of each question (:func:`~detectors.dior.early.batch_question_features`, the
    function build_early and ``assess`` call), ``batch`` questions per call; IG only when the detector reads the
    attribution (its ``attribution`` or ``entropy`` groups). A question is measured once per LLM and feature params and
    reused by every detector and configuration that asks again (the first computation's cost is reported with the
    reuse): the dior-early and utility triggers of every corpus share one measurement."""

    key, question = "early", ("early",)

    def __init__(self, detector, batch: int = 32):
        self.detector, self.batch = detector, batch
        self.attribution = bool({"attribution", "entropy"} & set(detector.groups))

    def _done(self, llm: LLM) -> dict[str, tuple[dict | Exception, int, float, bool]]:
        """The measurements shared by every calculator of ``llm`` with these feature params: question -> (columns or
        error, forward passes, seconds, with attribution)."""
        shared = _MEASURED.setdefault(llm.model, {})
        return shared.setdefault(json.dumps(dataclasses.asdict(self.detector.features), sort_keys=True), {})

    def questions(self, questions: list[str]) -> list[Measured]:
        from detectors.dior.early import batch_question_features, features_to_row

        llm = self.detector.require_llm()
        done = self._done(llm)
        todo = [q for q in dict.fromkeys(questions) if q not in done or (self.attribution and not done[q][3])]
        fresh = set(todo)
        for start in range(0, len(todo), self.batch):
            chunk = todo[start : start + self.batch]
            began = time.perf_counter()
            with ForwardCounter(llm.model) as counter:
                feats = batch_question_features(llm, chunk, self.detector.features, attribution=self.attribution)
            seconds = (time.perf_counter() - began) / len(chunk)
            for q, f in zip(chunk, feats):
                done[q] = (f if isinstance(f, RecordError) else features_to_row(f), counter.calls, seconds, self.attribution)
        return [Measured(*done[q][:3], fresh=q in fresh) for q in questions]


_MEASURED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()  # EarlyCalculator's, per LLM


def calculators_of(triggers) -> list[Calculator]:
    """The triggers' calculators, one per key (the first trigger's when several bring one)."""
    out: dict[str, Calculator] = {}
    for t in triggers:
        for c in t.calculators:
            out.setdefault(c.key, c)
    return list(out.values())


def providers(calculators: list[Calculator], always: tuple[str, ...] = ("prob", "entropy")) -> dict[str, str]:
    """Which calculator provides each statistic (``always``: the loop's own), refusing two providers of one name."""
    out = {name: "the loop" for name in always}
    for c in calculators:
        for name in (*c.provides, *c.lazy, *c.question):
            if name in out:
                raise ValueError(f"statistic {name!r} is provided by both {out[name]} and calculator {c.key!r}: use one trigger that needs it")
            out[name] = c.key
    return out

