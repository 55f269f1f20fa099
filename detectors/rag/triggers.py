"""Retrieval triggers: when a RAG loop retrieves, from registered detectors or training-free scores.

Every trigger gives a hallucination score (higher = retrieve) and fires at or above its ``threshold``:
- a *question* trigger scores the question before any token is generated (DioR early detection; ``always``,
  single-round RAG);
- a *token* trigger scores every token of the segment just generated (:class:`Segment`) and fires at the
  first token at or above the threshold. ``truncate`` says what is kept: ``"token"`` keeps the tokens before
  the flagged one (DioR real-time detection, DRAGIN, Stitch-in-Time: the generation continues from there),
  ``"segment"`` regenerates the whole segment (FLARE's look-ahead sentence, CtrlA's output segment).

Scores are the comparison's (``detectors.baselines``): FLARE 1 - p, RIND entropy x attention x content word,
Stitch-in-Time MIN 1 - min p over an entity's tokens (put on the entity's first token, where the generation is
cut), CtrlA ``-Eq. 2`` on new content words (so its threshold 0 is Eq. 2's τ) plus the refusal detector.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from detectors.errors import InputError
from detectors.llm.words import DEFAULT_STOPWORDS, content_mask

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

TRAINING_FREE = ("always", "flare", "rind", "sit_min")


@dataclasses.dataclass
class Segment:
    """The tokens generated since the last check, with what the loop measured while generating them."""

    question: str
    prompt_ids: list[int]  # everything before the segment: prompt (passages, question) and kept generated tokens
    gen_ids: list[int]
    prob: np.ndarray  # probability the LLM gave each token when choosing it
    entropy: np.ndarray
    text: str
    mlp: np.ndarray | None = None  # the real-time detector's P(hallucination) per token, when one is attached
    confidence: np.ndarray | None = None  # CtrlA monitor projections [prompt + gen, layers] of the generation's own passes


class Trigger:
    """One way of deciding to retrieve."""

    name: str
    threshold: float
    stage: ClassVar[Literal["question", "token"]] = "token"
    truncate: ClassVar[Literal["token", "segment"]] = "token"
    needs_mlp: ClassVar[bool] = False

    def question_score(self, question: str) -> float:
        raise NotImplementedError

    def token_scores(self, llm: "LLM", segment: Segment) -> np.ndarray:
        raise NotImplementedError

    def first(self, scores: np.ndarray) -> int | None:
        """The first token at or above the threshold (None: the trigger does not fire)."""
        hits = np.flatnonzero(np.asarray(scores, dtype=np.float64) >= self.threshold)
        return int(hits[0]) if len(hits) else None


@dataclasses.dataclass
class Always(Trigger):
    """Single-round RAG: retrieve once, before generating."""

    name: str = "always"
    threshold: float = 0.0
    stage: ClassVar = "question"

    def question_score(self, question: str) -> float:
        return 1.0


@dataclasses.dataclass
class EarlyTrigger(Trigger):
    """DioR early detection (Eq. 2): retrieve before generating when P(hallucination) >= the detector's threshold.
    Its keywords (Eq. 3) are kept for DioR's query.

    A question is assessed once (IG is the costly part) and the decision reused by every configuration and corpus
    that asks again; ``replayed`` then holds the forward passes and seconds it cost, which the loop adds to the
    question's counters, so each configuration reports the cost it would have had on its own."""

    detector: Any  # detectors.dior.early_detector.EarlyDetector
    name: str = "dior-early"
    threshold: float = 0.5
    stage: ClassVar = "question"

    def __post_init__(self) -> None:
        self.keywords: dict[str, list[str]] = {}
        self._assessed: dict[str, tuple[float, int, float]] = {}
        self.replayed: tuple[int, float] = (0, 0.0)

    def question_score(self, question: str) -> float:
        if question in self._assessed:
            probability, passes, seconds = self._assessed[question]
            self.replayed = (passes, seconds)
            return probability
        import time

        from detectors.rag.loop import ForwardCounter

        start = time.perf_counter()
        with ForwardCounter(self.detector.llm.model) as counter:
            decision = self.detector.assess(question)
        self.keywords[question] = decision.keywords
        self._assessed[question] = (decision.probability, counter.calls, time.perf_counter() - start)
        self.replayed = (0, 0.0)
        return decision.probability


@dataclasses.dataclass
class RealtimeTrigger(Trigger):
    """DioR real-time detection (Eq. 4): the MLP's P(hallucination) of each generated token; the generation is cut
    before the first token at or above the served threshold."""

    detector: Any  # detectors.dior.realtime_detector.RealtimeDetector
    name: str = "dior-realtime"
    threshold: float = 0.5
    needs_mlp: ClassVar[bool] = True

    def token_scores(self, llm: "LLM", segment: Segment) -> np.ndarray:
        return np.asarray(segment.mlp, dtype=np.float64)


@dataclasses.dataclass
class CtrlATrigger(Trigger):
    """CtrlA (Alg. 1, App. B): ``-Eq. 2`` of each new content word's tokens (other tokens never fire), from the
    confidence monitor's projections of the prompt and segment; a refusal (App. B.3.1) fires at the segment's start.
    The segment is regenerated after retrieval.

    The projections are those of the generation's own forward passes (``Segment.confidence``: the loop attaches
    the monitor while it generates, under its honesty steering, so nothing runs again); a segment without them
    is run once more under ``steering``."""

    detector: Any  # detectors.ctrla.detectors.ConfidenceDetector
    name: str = "ctrla-confidence"
    threshold: float = 0.0
    steering: dict | None = None  # honesty steering for segments that come without projections (as during generation)
    truncate: ClassVar = "segment"

    def __post_init__(self) -> None:
        self.eq2: np.ndarray = np.zeros(0)  # the last segment's Eq. 2 scores (CtrlA's masked query reads them)

    def monitor(self, llm: "LLM"):
        """The confidence monitor a loop attaches to its forward passes (the detector's layers)."""
        from detectors.ctrla.monitor import ConfidenceMonitor

        return ConfidenceMonitor(llm.model, self.detector.directions)

    def token_scores(self, llm: "LLM", segment: Segment) -> np.ndarray:
        from detectors.ctrla.monitor import detect_refusal, pooled_scores, project_sequences
        from detectors.ctrla.steering import steer

        n = len(segment.gen_ids)
        if n == 0:
            return np.zeros(0)
        p, directions = self.detector.params, self.detector.directions
        projections = segment.confidence
        if projections is None:
            with steer(llm.model, self.steering or {}):
                projections = project_sequences(llm, directions, [segment.prompt_ids + segment.gen_ids], directions.layers, 1)[0]
        self.eq2 = pooled_scores(projections, p.tau, p.clip)[-n:]
        context = llm.tokenizer.decode(segment.prompt_ids, skip_special_tokens=True)  # the input and the preceding generation
        mask = np.asarray(content_mask(llm.tokenizer, context, segment.gen_ids), dtype=bool)
        out = np.where(mask, -self.eq2, -np.inf)
        if detect_refusal(segment.text, list(p.refusal_patterns)):
            out[0] = np.inf
        return out


@dataclasses.dataclass
class FlareTrigger(Trigger):
    """FLARE: 1 - p of each token of the look-ahead segment; the segment is regenerated with retrieval."""

    name: str = "flare"
    threshold: float = 0.5
    truncate: ClassVar = "segment"

    def token_scores(self, llm: "LLM", segment: Segment) -> np.ndarray:
        return 1.0 - np.asarray(segment.prob, dtype=np.float64)


@dataclasses.dataclass
class RindTrigger(Trigger):
    """DRAGIN RIND of each token (one teacher-forced eager pass over prompt + segment): the generation is cut
    before the first token at or above the threshold."""

    name: str = "rind"
    threshold: float = 1.0
    stopwords: frozenset[str] = DEFAULT_STOPWORDS

    def token_scores(self, llm: "LLM", segment: Segment) -> np.ndarray:
        from detectors.baselines.rind import rind_scores

        if not segment.gen_ids:
            return np.zeros(0)
        return rind_scores(llm, [segment.prompt_ids], [segment.gen_ids], self.stopwords)[0].rind


@dataclasses.dataclass
class SitMinTrigger(Trigger):
    """Stitch-in-Time's concept-level MIN: 1 - the smallest probability of an entity's tokens (spaCy entities of
    the segment), on the entity's first token, where the generation is cut."""

    nlp: Any = None  # a loaded spaCy pipeline
    name: str = "sit_min"
    threshold: float = 0.5

    def token_scores(self, llm: "LLM", segment: Segment) -> np.ndarray:
        from detectors.dior.entities import entity_tokens, token_offsets

        out = np.full(len(segment.gen_ids), -np.inf)
        if not segment.gen_ids:
            return out
        offsets = token_offsets(llm, segment.gen_ids)
        text = llm.tokenizer.decode(segment.gen_ids, skip_special_tokens=True)
        for ent in self.nlp(text).ents:
            tokens = entity_tokens(offsets, ent.start_char, ent.end_char)
            if tokens:
                out[tokens[0]] = max(out[tokens[0]], 1.0 - float(np.min(segment.prob[tokens])))
        return out


def make_trigger(spec: str, llm: "LLM", thresholds: dict[str, float], spacy_model: str, tracking_uri: str | None = None) -> Trigger:
    """The trigger named ``spec``: ``always``, ``flare``, ``rind``, ``sit_min`` (thresholds from ``thresholds``) or
    ``<registered model>@<alias>`` loaded with :func:`detectors.load_detector` (from ``tracking_uri``) onto ``llm``;
    the detector's kind decides the trigger, and a detector built with another LLM is refused by its fingerprint."""
    if spec == "always":
        return Always()
    if spec in TRAINING_FREE:
        if spec not in thresholds:
            raise InputError(f"trigger {spec!r} has no threshold: give rag_eval.thresholds.{spec} (a number or `validation`)")
        if spec == "flare":
            return FlareTrigger(threshold=thresholds[spec])
        import spacy

        nlp = spacy.load(spacy_model)
        if spec == "rind":
            return RindTrigger(threshold=thresholds[spec], stopwords=frozenset(nlp.Defaults.stop_words))
        return SitMinTrigger(nlp=nlp, threshold=thresholds[spec])
    if "@" not in spec:
        raise InputError(f"trigger {spec!r}: name one of {', '.join(TRAINING_FREE)} or a registered detector as <name>@<alias>")
    name, alias = spec.split("@", 1)
    from detectors.inference import load_detector

    detector = load_detector(name, alias=alias, llm=llm, tracking_uri=tracking_uri)
    kind = detector.KIND
    if kind == "dior-early":
        return EarlyTrigger(detector=detector, name=name, threshold=float(detector.threshold))
    if kind == "dior-realtime":
        return RealtimeTrigger(detector=detector, name=name, threshold=float(detector.threshold))
    if kind == "ctrla-confidence":
        return CtrlATrigger(detector=detector, name=name, threshold=0.0)  # Eq. 2 already subtracts tau
    raise InputError(f"trigger {spec!r}: a {kind!r} detector does not decide retrieval (use dior-early, dior-realtime or ctrla-confidence)")
