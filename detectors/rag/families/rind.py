"""DRAGIN's RIND trigger and its calculator (the segments run once more, eagerly, on the loop's cached states)."""

from __future__ import annotations

import math

from detectors.baselines.rind import Rind, rind_on_kv
from detectors.interfaces import Level
from detectors.llm.kv import crop_kv
from detectors.llm.loading import LLM
from detectors.llm.words import spacy_stopwords
from detectors.rag.stats import Calculator, SegmentView
from detectors.rag.triggers import Policy, Trigger, TriggerContext, TriggerEntry


class RindCalculator(Calculator):
    """``rind``: DRAGIN's RIND of each generated token (:func:`~detectors.baselines.rind.rind_on_kv`): the segments
    run once more, in one eager batch, on the loop's cached states of their contexts, with the entropies the loop
    recorded (the real-time set's RIND, :func:`~detectors.baselines.rind.rind_scores`, is the same function on the
    stored continuations)."""

    key, provides, reads_kv = "rind", ("rind",), True

    def __init__(self, llm: LLM, stopwords: frozenset[str]):
        self.llm, self.stopwords = llm, stopwords

    def segments(self, views: list[SegmentView]) -> None:
        contexts = [crop_kv(v.kv, len(v.context_ids)) for v in views]
        traces = rind_on_kv(
            self.llm, contexts, [v.gen_ids for v in views], [v.stats["entropy"] for v in views], self.stopwords
        )
        for v, trace in zip(views, traces):
            v.stats["rind"] = trace.rind


def build(context: TriggerContext, settings: None) -> Trigger:
    stopwords = spacy_stopwords(context.spacy_model, "build_realtime.spacy_model")
    calculator = RindCalculator(context.llm, stopwords)
    return Trigger("rind", Rind(Level.TOKEN), math.inf, Policy("token"), (calculator,), scores=(0.0, math.inf))


RIND = TriggerEntry(build, offline=Rind)
