"""What a request to a serving engine asks of the detectors, and what it gets back (no vLLM import here).

A request asks in ``SamplingParams.extra_args`` (``vllm_xargs`` in an HTTP request's body):

- ``detector``: a registered real-time detector, ``name@alias`` (alias ``champion`` when left out), one whose trigger
  is one of :data:`SCORED_TRIGGERS`, as ``dior-realtime`` (its MLP's P(hallucination) of every generated token) or
  ``ctrla-confidence`` (CtrlA's Eq. 2 of every generated token, below 0 = unconfident);
- ``stop``: true (or 1) to stop the request at the first generated token whose score is at or over the detector's
  threshold (a ``realtime`` trigger's, as ``dior-realtime``'s; the completion then keeps that token and ends with
  :func:`stop_reason` of the detector);
- ``steering``: a registered ``ctrla-honesty`` direction, added at its layers for this request only, with
  ``lam`` (optional) its strength instead of the registered one;
- ``stats``: true to get each generated token's probability and the entropy of the distribution it was chosen from
  (what the real-time detectors and the training-free triggers read), with or without a detector;
- ``sentence``: true to end the request right after the first generated token that ends a sentence
  (:func:`detectors.llm.words.ends_sentence`: where the RAG loop ends a segment); the completion then ends with the
  stop reason :data:`SENTENCE_REASON`.

Each output gets :class:`Scored` back (``completion.dynrag`` offline, ``choices[i].dynrag`` over HTTP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from detectors.errors import InputError

DETECTOR, STOP, STEERING, LAM, STATS, SENTENCE = "detector", "stop", "steering", "lam", "stats", "sentence"
KEYS = (DETECTOR, STOP, STEERING, LAM, STATS, SENTENCE)
# set by the engine's front end on its own copy of a request's params (never by a user): where the engine keeps the
# request's results (the request id the front end answers with) and the token that stops it
RESULT_KEY, STOP_TOKEN = "_dynrag_request", "_dynrag_stop_token"
STOP_REASON_PREFIX = "detector:"
SENTENCE_REASON = "sentence"  # the stop reason of a request ended at a sentence end
# ``detector`` serves a registered detector by the trigger its class names (``Detector.TRIGGER``), so a new kind that
# decides like one of these is served as it is: ``realtime`` scores each generated token from its hidden states
# (``state_indices``, ``score_tokens``), ``ctrla`` with CtrlA's Eq. 2 (``monitor``)
SCORED_TRIGGERS = ("realtime", "ctrla")
STOPPING_TRIGGERS = ("realtime",)  # a threshold on one token's score; CtrlA's trigger needs the text's words
READS_PROMPT = ("ctrla",)  # Eq. 2's running statistics read every prompt position: no prefix cache
STEERING_KINDS = ("ctrla-honesty",)  # what ``steering`` serves


class ServingRequestError(InputError, ValueError):
    """A request asks the detectors for something they cannot serve: the message names the value and what to do."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """A registered model by name and alias, as a request names it (``name@alias``)."""

    name: str
    alias: str = "champion"

    @classmethod
    def parse(cls, value: Any, key: str) -> Spec:
        if not isinstance(value, str) or not value.strip():
            raise ServingRequestError(f"{key} = {value!r}: name a registered model as 'name' or 'name@alias'")
        name, _, alias = value.strip().partition("@")
        if not name or (_ and not alias) or "@" in alias:
            raise ServingRequestError(f"{key} = {value!r}: name a registered model as 'name' or 'name@alias'")
        return cls(name, alias or "champion")

    def __str__(self) -> str:
        return f"{self.name}@{self.alias}"


@dataclasses.dataclass(frozen=True)
class DetectorRequest:
    """What one request asks: a detector to score its tokens (and stop it), a steering direction, its tokens'
    probabilities and entropies, an end at the first sentence end, or any of them together."""

    detector: Spec | None = None
    stop: bool = False
    steering: Spec | None = None
    lam: float | None = None
    stats: bool = False
    sentence: bool = False

    @property
    def stops(self) -> bool:
        """Whether the engine may end it before its budget (at the detector's threshold or a sentence end)."""
        return self.stop or self.sentence

    @classmethod
    def of(cls, extra_args: dict[str, Any] | None) -> DetectorRequest | None:
        """The request in ``extra_args`` (None when it asks nothing of the detectors); a bad value is one
        :class:`ServingRequestError` naming it."""
        args = extra_args or {}
        if not any(args.get(k) is not None for k in KEYS):
            return None
        detector = Spec.parse(args[DETECTOR], DETECTOR) if args.get(DETECTOR) is not None else None
        steering = Spec.parse(args[STEERING], STEERING) if args.get(STEERING) is not None else None
        stop = _flag(args.get(STOP), STOP)
        lam = args.get(LAM)
        if stop and detector is None:
            raise ServingRequestError(f"{STOP} = {args[STOP]!r} needs a '{DETECTOR}' to stop on: name one")
        if lam is not None:
            if steering is None:
                raise ServingRequestError(f"{LAM} = {lam!r} is a steering strength: name a '{STEERING}' direction too")
            try:
                lam = float(lam)
            except (TypeError, ValueError):
                lam = math.nan
            if not math.isfinite(lam):
                raise ServingRequestError(f"{LAM} = {args[LAM]!r}: give a finite number")
        stats, sentence = _flag(args.get(STATS), STATS), _flag(args.get(SENTENCE), SENTENCE)
        if detector is None and steering is None and not (stats or sentence):
            raise ServingRequestError(
                f"extra args {sorted(args)}: name a '{DETECTOR}' or a '{STEERING}', or set '{STATS}' or '{SENTENCE}'"
            )
        return cls(detector, stop, steering, lam, stats, sentence)

    def loads(self) -> list[tuple[Spec, str]]:
        """The registered models this request needs, each with its role (``detector`` or ``steering``)."""
        return [(s, role) for s, role in ((self.detector, DETECTOR), (self.steering, STEERING)) if s is not None]


def _flag(value: Any, key: str) -> bool:
    if value is None or value is False or value == 0:
        return False
    if value is True or value == 1:
        return True
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ServingRequestError(f"{key} = {value!r}: give true or false")


def check_kind(spec: Spec, kind: str, trigger: str | None, role: str) -> None:
    """Refuse a registered model the engine cannot serve in ``role`` (a detector by its ``trigger``, a steering
    direction by its ``kind``), naming what it serves."""
    if trigger in SCORED_TRIGGERS if role == DETECTOR else kind in STEERING_KINDS:
        return
    served = f"'{DETECTOR}' scores every generated token with a detector whose trigger is "
    served += f"{' or '.join(SCORED_TRIGGERS)}; '{STEERING}' steers with {' or '.join(STEERING_KINDS)}"
    raise ServingRequestError(
        f"{role} = {str(spec)!r} is a {kind} detector (trigger {trigger}), which the engine cannot serve as a "
        f"{role}: {served} (a detector that decides before generating runs with detectors.load_detector)"
    )


def check_stop(request: DetectorRequest, kind: str, trigger: str | None) -> None:
    """Refuse ``stop`` for a detector whose firing rule is not a threshold on one token's score."""
    if request.stop and trigger not in STOPPING_TRIGGERS:
        raise ServingRequestError(
            f"{STOP} with {DETECTOR} = {str(request.detector)!r} ({kind}): its trigger fires on an unconfident new "
            "content word, which needs the text's words (detectors.ctrla.monitor.trigger_position): read its scores; "
            f"'{STOP}' serves a detector whose trigger is {' or '.join(STOPPING_TRIGGERS)}"
        )


def stop_reason(spec: Spec | str) -> str:
    """The stop reason of a request the detector ``spec`` stopped (a completion's ``stop_reason``)."""
    return f"{STOP_REASON_PREFIX}{spec}"


def stopped_by_detector(reason: Any) -> bool:
    """Whether a completion's ``stop_reason`` says a detector stopped it (retrieve there)."""
    return isinstance(reason, str) and reason.startswith(STOP_REASON_PREFIX)


@dataclasses.dataclass
class Scored:
    """What a request gets back: one score per generated token (None for a token the engine never ran, the last
    one of a request cut at its token budget, and the end-of-sequence token), the threshold of a detector that stops
    on one, the first token at or over it, and whether the detector stopped the request there; with ``stats``, each
    generated token's probability and entropy (None for the end-of-sequence token that ended it); with ``sentence``,
    whether it ended at a sentence end."""

    detector: str | None
    kind: str | None
    scores: list[float | None]
    threshold: float | None
    trigger: int | None
    stopped: bool
    steering: str | None = None
    lam: float | None = None
    probs: list[float | None] = dataclasses.field(default_factory=list)
    entropies: list[float | None] = dataclasses.field(default_factory=list)
    sentence_end: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def scored(
    request: DetectorRequest, info: dict[str, Any] | None, token_ids: list[int], stop_token: int | None
) -> Scored:
    """The result of ``request`` from what the engine recorded (``info``: ``scores`` in generation order, the
    detector's ``kind``, its ``threshold`` when it stops on one, the steering's ``lam``), aligned with the output's
    ``token_ids``."""
    info = info or {}
    ended = bool(token_ids) and stop_token is not None and token_ids[-1] == stop_token
    n = len(token_ids) - (1 if ended else 0)

    def aligned(values: list) -> list[float | None]:
        return [float(v) for v in values[:n]] + [None] * max(0, len(token_ids) - min(len(values), n))

    scores = aligned(list(info.get("scores") or []))
    threshold = info.get("threshold")
    kind = info.get("kind")
    trigger = None
    if threshold is not None:  # the engine reports a threshold for a detector that stops on one only
        trigger = next((i for i, s in enumerate(scores) if s is not None and s >= threshold), None)
    return Scored(
        detector=None if request.detector is None else str(request.detector),
        kind=kind,
        scores=scores if request.detector is not None else [],
        threshold=threshold,
        trigger=trigger,
        stopped=request.stop and trigger is not None,
        steering=None if request.steering is None else str(request.steering),
        lam=info.get("lam"),
        probs=aligned(list(info.get("probs") or [])) if request.stats else [],
        entropies=aligned(list(info.get("entropies") or [])) if request.stats else [],
        sentence_end=request.sentence and ended and 0 < n <= len(info.get("ends") or []) and bool(info["ends"][n - 1]),
    )
