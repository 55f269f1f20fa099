"""What the RAG loop measures while the LLM generates, under the names and meanings of the stored sets.

A generated segment's ``stats`` hold one value per generated token: ``prob`` and ``entropy`` (always: the
distribution each token was chosen from), and what the triggers' calculators add: ``mlp`` (the real-time
detector's P(hallucination)), ``rind`` (DRAGIN), ``ctrla_confidence`` (CtrlA's -Eq. 2) and ``entities`` (the token
indices of each spaCy entity), the per-token statistics of the real-time set (:mod:`detectors.evaluation.units`).
A question's ``question_stats`` are the early set's columns (:func:`detectors.dior.early.features_to_row`). So a
scorer (:mod:`detectors.evaluation.scorers`, :mod:`detectors.baselines`) computes the same score from a stored set
offline and from the generation online: one definition of each score.

A :class:`Calculator` provides some of these statistics for a batch of segments (or questions) at once; each trigger
family brings its own (:mod:`detectors.rag.families`). It may
ask the loop for a *probe* (``key``, a context manager attaching hooks, ``take() -> [B, T, d]``): the loop runs its
forward passes with the probe attached and keeps what it recorded at every position of every row, so hidden
states (:class:`~detectors.llm.layers.StateTap`) and CtrlA's projections
(:class:`~detectors.ctrla.monitor.ConfidenceMonitor`) come from the generation itself, never from a second pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class SegmentView:
    """One generated segment as the triggers and query formulations see it."""

    question: str
    context_ids: list[int]  # everything before the segment: the prompt (passages, question) and the kept answer tokens
    gen_ids: list[int]
    text: str  # the segment decoded
    stats: dict[str, Any]  # per generated token (see the module's docstring)
    # calculator key -> its probe's values at every position of context + segment, [len, d]
    probes: dict[str, torch.Tensor]
    question_stats: dict[str, Any]
    providers: dict[str, Calculator] = dataclasses.field(default_factory=dict)  # who computes a lazy statistic
    kv: Any = None  # the LLM's key/value cache of context + segment (what the loop ran), for calculators that run more
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
    # a registered detector (name@alias) a serving engine scores every generated token with, giving ``provides[0]``
    # itself (detectors.rag.decoder.VllmDecoder); None: only the loop's own passes compute it
    served: str | None = None
    reads_kv: bool = False  # it runs the LLM on the segment's key/value cache (only the loop's own decoder keeps one)

    def segments(self, views: list[SegmentView]) -> None:
        """Add the ``provides`` statistics to each view's ``stats`` (every view holds at least one token)."""

    def lazy_stat(self, name: str, view: SegmentView) -> Any:
        raise KeyError(name)

    def questions(self, questions: list[str]) -> list[Measured]:
        return []


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
                raise ValueError(
                    f"statistic {name!r} is provided by both {out[name]} and calculator {c.key!r}: use one "
                    f"trigger that needs it"
                )
            out[name] = c.key
    return out
