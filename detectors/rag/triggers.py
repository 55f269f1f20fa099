"""Retrieval triggers: a scorer, a threshold, a policy and a controller.

The scorer is the one the comparison evaluates offline (:mod:`detectors.baselines`,
:mod:`detectors.evaluation.scorers`),
computed online from the statistics the loop measures while the LLM generates (:mod:`detectors.rag.stats`, same names
as the stored sets); the trigger fires at or above its threshold. The policy says when and how:

- ``stage="question"``: the question is scored before anything is generated (DioR early detection; ``always``,
  single-round RAG) from the early set's columns;
- ``stage="token"``: every token of the segment just generated is scored, and the trigger fires at the first one at
  or above the threshold; ``cut="token"`` keeps the tokens before it (DioR real-time detection, DRAGIN,
  Stitch-in-Time: generation continues from there), ``cut="segment"`` regenerates the whole segment (FLARE's
  look-ahead sentence, CtrlA's output segment); ``eligible`` names a per-token boolean statistic outside of which it
  never fires (CtrlA: new content words), ``forced`` a boolean statistic of the segment that fires it at the
  segment's first token (CtrlA's refusal detector); ``after_retrieval="accept"`` keeps the segment regenerated after
  the trigger's retrieval without scoring it (CtrlA's Alg. 1, lines 6-10: re-predict the segment and append it),
  ``"rescore"`` scores it like any segment, up to ``max_retrievals``; ``passages="segment"`` keeps the passages for
  that re-predicted segment only, and the segments after it are predicted from the prompt without them (CtrlA's
  Alg. 1, line 4: the next segment given (x, y<t)), ``"keep"`` leaves them in the prompt until the next retrieval.

What a firing does beyond that is its ``controller``'s (:mod:`detectors.rag.controllers`): the plain retrieval with
the loop's query; the utility trigger's gate on the passages (:mod:`~detectors.rag.controllers.gate`);
Stitch-in-Time's validation and repair (:mod:`~detectors.rag.controllers.validation`); CtrlA's refusal handling H_R
(:mod:`~detectors.rag.controllers.refusal`).

A trigger brings the calculators of the statistics its scorer needs; the loop knows no concrete trigger.

Each trigger family is one module of :mod:`detectors.rag.families` holding a :class:`TriggerEntry` per trigger, and one
line of :mod:`detectors.extensions` naming it: the entry builds the trigger from a :class:`TriggerContext` and its own
settings (``rag_eval.settings.<entry name>``, of the type the entry declares), and names its offline scorer (the
comparison lists it among the real-time baselines).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pandas as pd

from detectors.errors import InputError
from detectors.evaluation.metrics import first_hit
from detectors.interfaces import Level
from detectors.rag.controllers import RETRIEVE, Controller
from detectors.rag.stats import Calculator


@dataclasses.dataclass(frozen=True)
class Policy:
    """When a trigger is read and what its firing does (see the module's docstring)."""

    stage: Literal["question", "token"]
    cut: Literal["token", "segment"] = "token"
    eligible: str | None = None
    forced: str | None = None
    after_retrieval: Literal["rescore", "accept"] = "rescore"
    passages: Literal["keep", "segment"] = "keep"


@dataclasses.dataclass(frozen=True)
class Constant:
    """The same score for every question: single-round RAG retrieves for every question below it."""

    name: str = "always"
    value: float = 1.0
    level: Level = Level.QUESTION
    kind: str = "baseline"
    is_probability: bool = False
    threshold: float | None = None
    features: str = "none"

    def score(self, units: pd.DataFrame) -> np.ndarray:
        return np.full(len(units), self.value)


@dataclasses.dataclass
class Trigger:
    """A scorer, the threshold at or above which it fires, the policy, and the calculators its scorer needs."""

    name: str
    scorer: Any  # question stage: ``score(units)`` over the early set's columns; token stage: ``token_scores(stats)``
    threshold: float
    policy: Policy
    calculators: tuple[Calculator, ...] = ()
    scores: tuple[float, float] = (-math.inf, math.inf)  # the range of its scores (a threshold outside it is refused)
    controller: Controller = RETRIEVE  # what its firing does (detectors.rag.controllers)
    source: str = ""  # the module that built it (detectors.rag.families.<family>)
    detector: Any = None  # the registered detector it serves, if any
    settings: Any = None  # its entry's own settings (rag_eval.settings.<entry>): part of the key of a run that reads it
    entry: str = ""  # the registry entry that built it (TRAINING_FREE's name, or the detector's kind)

    def parts(self) -> list[Any]:
        """Everything it runs: its scorer, calculators, controller (and what it runs) and detector (whose modules are
        its code)."""
        parts = (self.scorer, *self.calculators, self.controller, *self.controller.parts(), self.detector)
        return [p for p in parts if p is not None]

    @property
    def stage(self) -> str:
        return self.policy.stage

    @property
    def needs(self) -> tuple[str, ...]:
        """The segment statistics it reads (none for a question trigger, whose calculators provide its columns)."""
        if self.stage == "question":
            return ()
        return tuple(dict.fromkeys((*self.scorer.needs, *(s for s in (self.policy.eligible, self.policy.forced) if s))))

    def question_scores(self, rows: list[dict]) -> np.ndarray:
        """One score per question from its early-set columns (``rows``), with the scorer's offline function."""
        return np.asarray(self.scorer.score(pd.DataFrame(rows)), dtype=np.float64)

    def token_scores(self, stats: dict[str, Any]) -> np.ndarray:
        """One score per generated token of a segment: the scorer's, -inf where the policy says it cannot fire, +inf
        on the first token when the policy's ``forced`` statistic is set."""
        scores = np.array(self.scorer.token_scores(stats), dtype=np.float64)
        if self.policy.eligible:
            scores = np.where(np.asarray(stats[self.policy.eligible], dtype=bool), scores, -np.inf)
        if self.policy.forced and stats[self.policy.forced] and len(scores):
            scores[0] = np.inf
        return scores

    def first(self, scores: np.ndarray) -> int | None:
        """The first token at or above the threshold (None: the trigger does not fire)."""
        return first_hit(np.asarray(scores, dtype=np.float64) >= self.threshold)

    def cut_at(self, position: int) -> int:
        """How many tokens of the segment stay when it fires at ``position``."""
        return position if self.policy.cut == "token" else 0


# ---- building triggers by name -----------------------------------------------------------------------------

PROBABILITY = (0.0, 1.0)


@dataclasses.dataclass
class TriggerContext:
    """What a trigger's builder reads besides its own settings: the LLM the loop generates with, the spaCy pipeline
    (``spacy_model``, loaded once, on first use, for every trigger built with this context) and, for the kind of a
    registered detector, the trigger's ``name``, the ``detector`` attached to that LLM and the ``spec`` it was loaded
    by (``name@alias``: what a serving engine loads to score with it)."""

    llm: Any
    spacy_model: str = ""
    name: str = ""
    detector: Any = None
    spec: str = ""

    @functools.cached_property
    def nlp(self) -> Any:
        if not self.spacy_model:
            raise InputError("this trigger needs a spaCy model: pass build_realtime.spacy_model to make_trigger")
        import spacy

        return spacy.load(self.spacy_model)


@dataclasses.dataclass(frozen=True)
class TriggerEntry:
    """One trigger of a family (the object :data:`detectors.extensions.TRAINING_FREE` and
    :data:`~detectors.extensions.DETECTOR_TRIGGERS` name): ``build(context, settings)`` makes it (a training-free one
    without its threshold: +inf until one is set), ``settings`` is the type of its own params
    (``rag_eval.settings.<entry name>``, a detector's ``rag_eval.settings.<kind>``; None: it takes none; the builder
    gets None when they are not given) and
    ``offline`` its scorer's class (a :class:`~detectors.evaluation.scorers.TokenStatScorer` over the real-time set's
    statistics), which the comparison lists among the real-time baselines (None: it has no offline score)."""

    build: Callable[[TriggerContext, Any], Trigger]
    settings: type | None = None
    offline: type | None = None


def check_threshold(trigger: Trigger, value: float, key: str) -> None:
    """A fixed threshold of ``trigger`` must lie in the range of its scores (a finite value outside it would make the
    trigger fire always or never; use inf to never retrieve)."""
    low, high = trigger.scores
    if not (low <= value <= high or math.isinf(value)):
        raise InputError(
            f"{key} = {value!r}: {trigger.name}'s scores lie in [{low:g}, {high:g}]: choose a threshold in that range "
            "(inf never retrieves), or remove the key to choose it on the validation sweep"
        )
