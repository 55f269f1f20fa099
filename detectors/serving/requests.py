"""What a request to a serving engine asks of the detectors, and what it gets back (no vLLM import here).

A request asks in ``SamplingParams.extra_args`` (``vllm_xargs`` in an HTTP request's body):

- ``detector``: a registered real-time detector, ``name@alias`` (alias ``champion`` when left out): ``dior-realtime``
  (its MLP's P(hallucination) of every generated token) or ``ctrla-confidence`` (CtrlA's Eq. 2 of every generated
  token, below 0 = unconfident);
- ``stop``: true (or 1) to stop the request at the first generated token whose score is at or over the detector's
  threshold (``dior-realtime``; the completion then keeps that token and ends with :func:`stop_reason` of the detector);
- ``steering``: a registered ``ctrla-honesty`` direction, added at its layers for this request only, with
  ``lam`` (optional) its strength instead of the registered one.

Each output gets :class:`Scored` back (``completion.dynrag`` offline, ``choices[i].dynrag`` over HTTP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from detectors.errors import InputError

DETECTOR, STOP, STEERING, LAM = "detector", "stop", "steering", "lam"
KEYS = (DETECTOR, STOP, STEERING, LAM)
# set by the engine's front end on its own copy of a request's params (never by a user): where the engine keeps the
# request's results (the request id the front end answers with) and the token that stops it
RESULT_KEY, STOP_TOKEN = "_dynrag_request", "_dynrag_stop_token"
STOP_REASON_PREFIX = "detector:"
SCORED_KINDS = ("dior-realtime", "ctrla-confidence")  # what ``detector`` serves (per generated token)
STEERING_KINDS = ("ctrla-honesty",)
STOPPING_KINDS = ("dior-realtime",)  # a threshold on one token's score; CtrlA's trigger needs the text's words
READS_PROMPT = ("ctrla-confidence",)  # Eq. 2's running statistics read every prompt position: no prefix cache


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
    """What one request asks: a detector to score its tokens (and stop it), a steering direction, or both."""

    detector: Spec | None = None
    stop: bool = False
    steering: Spec | None = None
    lam: float | None = None

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
        if detector is None and steering is None:
            raise ServingRequestError(f"extra args {sorted(args)}: name a '{DETECTOR}' or a '{STEERING}'")
        return cls(detector, stop, steering, lam)

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


def check_kind(spec: Spec, kind: str, role: str) -> None:
    """Refuse a registered model of a kind the engine cannot serve in ``role``, naming what it serves."""
    allowed = SCORED_KINDS if role == DETECTOR else STEERING_KINDS
    if kind not in allowed:
        served = f"'{DETECTOR}' scores every generated token with {' or '.join(SCORED_KINDS)}; "
        served += f"'{STEERING}' steers with {' or '.join(STEERING_KINDS)}"
        raise ServingRequestError(
            f"{role} = {str(spec)!r} is a {kind} detector, which the engine cannot serve as a {role}: {served} "
            "(a detector that decides before generating runs with detectors.load_detector)"
        )


def check_stop(request: DetectorRequest, kind: str) -> None:
    """Refuse ``stop`` for a detector whose firing rule is not a threshold on one token's score."""
    if request.stop and kind not in STOPPING_KINDS:
        raise ServingRequestError(
            f"{STOP} with {DETECTOR} = {str(request.detector)!r} ({kind}): its trigger fires on an unconfident new "
            "content word, which needs the text's words (detectors.ctrla.monitor.trigger_position): read its scores; "
            f"'{STOP}' serves {' or '.join(STOPPING_KINDS)}"
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
    one of a request cut at its token budget, and the end-of-sequence token), the detector's threshold, the first
    token at or over it (``dior-realtime``), and whether the detector stopped the request there."""

    detector: str | None
    kind: str | None
    scores: list[float | None]
    threshold: float | None
    trigger: int | None
    stopped: bool
    steering: str | None = None
    lam: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def scored(
    request: DetectorRequest, info: dict[str, Any] | None, token_ids: list[int], stop_token: int | None
) -> Scored:
    """The result of ``request`` from what the engine recorded (``info``: ``scores`` in generation order, the
    detector's ``kind``, ``threshold``, the steering's ``lam``), aligned with the output's ``token_ids``."""
    info = info or {}
    raw = list(info.get("scores") or [])
    n = len(token_ids) - (1 if token_ids and stop_token is not None and token_ids[-1] == stop_token else 0)
    scores: list[float | None] = [float(s) for s in raw[:n]] + [None] * max(0, len(token_ids) - min(len(raw), n))
    threshold = info.get("threshold")
    kind = info.get("kind")
    trigger = None
    if kind in STOPPING_KINDS and threshold is not None:
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
    )
