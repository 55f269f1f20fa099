"""Accuracy vs retrieval rate of a trigger over its threshold, from never to always retrieving.

A trigger retrieves once, at its first crossing: the first token (or the question, for an early trigger) whose score
is at or above the threshold. As the threshold falls from +inf, a question's first crossing appears at the first
token reaching the threshold and then moves earlier; it only changes at the *records* of the running max of its
scores (a token scoring strictly above every earlier one). So a question is described by its records, ``events``:
``(score, position)`` pairs with positions and scores both increasing (:func:`records`; an early trigger has one
event, its question score at position 0), the correctness of the no-retrieval answer (``never``) and the correctness
of the answer after retrieving at each event's position (``at``; position 0 is always needed: it is the
always-retrieve reference). At threshold τ the question retrieves at the position of its earliest event with
score ≥ τ, or not at all.

:func:`curve` evaluates every threshold exactly: one point at +inf (never retrieve) and one at each distinct event
score, from the highest to the lowest (below the lowest nothing changes). Equal scores change together at one
point, so ties never depend on the order of the questions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from detectors.evaluation.answer_metrics import accuracy


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One question for one trigger: its events, and whether the answer is right without and after retrieval."""

    events: list[tuple[float, int]]  # (score, position) records of the running max; positions and scores increasing
    never: bool  # correct without retrieval
    at: dict[int, bool]  # correct after one retrieval at this position (every event's position, and 0)

    def __post_init__(self) -> None:
        if 0 not in self.at:
            raise ValueError(
                f"outcome {self}: `at` lacks position 0, the always-retrieve answer that every curve is read against"
            )
        for (s0, p0), (s1, p1) in zip(self.events, self.events[1:]):
            if not (s1 > s0 and p1 > p0):
                raise ValueError(
                    f"outcome events {self.events} are not records of a running max (scores and positions "
                    f"increasing); build them with records()"
                )
        missing = sorted({p for _, p in self.events} - set(self.at))
        if missing:
            raise ValueError(f"outcome `at` lacks the correctness at positions {missing} where the trigger can fire")


def records(scores: Sequence[float], truncate: str = "token") -> list[tuple[float, int]]:
    """The ``(score, position)`` records of the running max of one answer's token scores: the thresholds at which
    the first crossing moves. NaN scores never cross. ``truncate="segment"`` (FLARE, CtrlA: the whole segment is
    regenerated) puts every crossing at position 0, so there is one event, the maximum score."""
    scores = np.asarray(scores, dtype=np.float64)
    finite = np.flatnonzero(~np.isnan(scores))
    if truncate == "segment":
        return [(float(scores[finite].max()), 0)] if len(finite) else []
    if truncate != "token":
        raise ValueError(f"truncate {truncate!r}: use 'token' or 'segment'")
    out: list[tuple[float, int]] = []
    for i in finite:
        if not out or scores[i] > out[-1][0]:
            out.append((float(scores[i]), int(i)))
    return out


@dataclasses.dataclass(frozen=True)
class Curve:
    """Accuracy vs retrieval rate of one trigger: ``threshold[i]`` gives ``retrieval_rate[i]`` and ``accuracy[i]``
    (``threshold[0]`` is +inf: never retrieve). ``area`` integrates the curve over retrieval rate in [0, 1];
    ``random_area`` is a random trigger's; ``rate_to_always`` the smallest retrieval rate at which the trigger
    reaches the always-retrieve accuracy (None if it never does)."""

    trigger: str
    threshold: np.ndarray
    retrieval_rate: np.ndarray
    accuracy: np.ndarray
    never_accuracy: float
    always_accuracy: float
    area: float
    random_area: float
    rate_to_always: float | None

    interval: tuple[float, float] = (float("nan"), float("nan"))  # 95% bootstrap interval of area - random_area
    best_free: str | None = (
        None  # the training-free trigger of largest area on the same questions (itself, if it is that one)
    )
    over_best_free: float = float("nan")  # area - its area
    over_best_free_interval: tuple[float, float] = (float("nan"), float("nan"))  # paired 95% bootstrap interval

    def summary(self) -> dict[str, Any]:
        """The curve's numbers for the metrics file (JSON-able)."""
        return {
            "area": self.area,
            "random_area": self.random_area,
            "area_over_random": self.area - self.random_area,
            "area_over_random_ci_low": self.interval[0],
            "area_over_random_ci_high": self.interval[1],
            "never_accuracy": self.never_accuracy,
            "always_accuracy": self.always_accuracy,
            "rate_to_always": self.rate_to_always,
            "points": len(self.threshold),
            "best_training_free": self.best_free,
            "area_over_best_training_free": self.over_best_free,
            "area_over_best_training_free_ci_low": self.over_best_free_interval[0],
            "area_over_best_training_free_ci_high": self.over_best_free_interval[1],
        }

    def rows(self) -> list[dict[str, Any]]:
        """One row per threshold (``trigger, threshold, retrieval_rate, accuracy``) for the curves CSV."""
        return [
            {"trigger": self.trigger, "threshold": float(t), "retrieval_rate": float(r), "accuracy": float(a)}
            for t, r, a in zip(self.threshold, self.retrieval_rate, self.accuracy)
        ]


def curve(trigger: str, outcomes: Sequence[Outcome], tolerance: float = 1e-9) -> Curve:
    """The accuracy vs retrieval-rate curve of ``trigger`` over ``outcomes`` (one per question).

    Area: trapezoids over the points in threshold order (a threshold that only moves retrievals earlier gives a
    vertical step, which adds no area). A trigger that never fires on some questions (e.g. an empty answer has no
    token to score) ends below retrieval rate 1; the curve is closed with a straight line to rate 1 and the accuracy
    of also retrieving those questions at position 0, which is what retrieving a random share of them gives.
    ``rate_to_always`` is read on the points (the closing point included), within ``tolerance``."""
    n = len(outcomes)
    if n == 0:
        raise ValueError(f"trigger {trigger!r}: no questions to sweep")
    never = np.array([o.never for o in outcomes], dtype=np.float64)
    always = np.array([o.at[0] for o in outcomes], dtype=np.float64)
    # each event: when the threshold reaches its score, its question moves to its position (an earlier one)
    score, delta_correct, delta_retrieved = [], [], []
    for o, base in zip(outcomes, never):
        previous = base
        for k, (s, p) in enumerate(reversed(o.events)):  # highest score first: the order the threshold meets them
            now = float(o.at[p])
            score.append(s), delta_correct.append(now - previous), delta_retrieved.append(1.0 if k == 0 else 0.0)
            previous = now
    score = np.asarray(score, dtype=np.float64)
    order = np.argsort(-score, kind="stable")
    score = score[order]
    correct = never.sum() + np.cumsum(np.asarray(delta_correct)[order]) if len(order) else np.zeros(0)
    retrieved = np.cumsum(np.asarray(delta_retrieved)[order]) if len(order) else np.zeros(0)
    # end of each tie group
    last = np.flatnonzero(np.r_[score[1:] != score[:-1], True]) if len(score) else np.zeros(0, dtype=int)
    threshold = np.r_[np.inf, score[last]]
    rate = np.r_[0.0, retrieved[last] / n]
    acc = np.r_[never.mean(), correct[last] / n]
    reached = np.array([bool(o.events) for o in outcomes])
    close_acc = (acc[-1] * n + (always[~reached] - never[~reached]).sum()) / n
    xs, ys = np.r_[rate, 1.0], np.r_[acc, close_acc]
    area = float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))
    always_accuracy = float(always.mean())
    hit = np.flatnonzero(ys >= always_accuracy - tolerance)
    return Curve(
        trigger,
        threshold,
        rate,
        acc,
        float(never.mean()),
        always_accuracy,
        area,
        random_area=(float(never.mean()) + always_accuracy) / 2,
        rate_to_always=float(xs[hit].min()) if len(hit) else None,
    )


def operating_point(c: Curve, budget: float | None = None) -> float:
    """The threshold of ``c``'s most accurate point (the one retrieving least among equally accurate points), or of the
    most accurate point retrieving at most ``budget`` of the questions: how a trigger's operating threshold is chosen on
    validation questions (never on the questions it is then judged on)."""
    ok = np.ones(len(c.threshold), dtype=bool) if budget is None else c.retrieval_rate <= budget + 1e-12
    best = np.flatnonzero(ok & (c.accuracy >= c.accuracy[ok].max() - 1e-12))
    return float(c.threshold[best[np.argmin(c.retrieval_rate[best])]])


NEVER, ALWAYS = math.inf, -math.inf  # the thresholds at which a trigger never and always fires
CANDIDATES = ("never", "always", "best")  # what candidate_thresholds' first three are; then "rate <r>" for each rate


def candidate_thresholds(c: Curve, rates: Sequence[float]) -> list[float]:
    """The thresholds a configuration is tried at on the validation questions (rag_eval runs the configuration's own
    procedure at each and chooses among them with :func:`~detectors.evaluation.choice.choose`): never and always
    firing (+inf, -inf: every configuration's two defaults), the curve's most accurate point
    (:func:`operating_point`), then, for each of ``rates``, the point whose retrieval rate is nearest it (the higher
    threshold of equally near ones). In that order (named by :func:`candidate_names`); a threshold may repeat."""
    out = [NEVER, ALWAYS, operating_point(c)]
    for r in rates:
        # first of the nearest: the highest threshold
        out.append(float(c.threshold[int(np.argmin(np.abs(c.retrieval_rate - r)))]))
    return out


def candidate_names(rates: Sequence[float]) -> list[str]:
    """What each of :func:`candidate_thresholds`' thresholds is, in its order."""
    return [*CANDIDATES, *(f"rate {r:g}" for r in rates)]


def question_outcomes(
    scores: Sequence[float], correct_without: Sequence[bool], correct_with: Sequence[bool]
) -> list[Outcome]:
    """Outcomes of a question-level score (one event at position 0; none for NaN) from each question's correctness
    without and with its passages."""
    return [
        Outcome([] if math.isnan(s) else [(float(s), 0)], bool(n), {0: bool(w)})
        for s, n, w in zip(scores, correct_without, correct_with)
    ]


def outcome_from_json(data: dict[str, Any], trigger: str) -> Outcome:
    """One trigger's :class:`Outcome` from a stored sweep line (``events: {trigger: [[score, position], ...]}``,
    ``never``, ``at: {"<position>": correct}``; JSON keys are strings)."""
    return Outcome(
        [(float(s), int(p)) for s, p in data["events"][trigger]],
        bool(data["never"]),
        {int(p): bool(c) for p, c in data["at"].items()},
    )


def area_interval(
    trigger: str, outcomes: Sequence[Outcome], n: int = 1000, seed: int = 0, reference: Sequence[Outcome] | None = None
) -> tuple[float, float]:
    """95% bootstrap interval of a curve's area minus a random trigger's (or, paired, minus the area of the
    ``reference`` trigger's outcomes on the same questions), resampling the questions: both areas are measured on the
    same resampled questions, so what they share cancels out."""
    draws = np.random.default_rng(seed).integers(0, len(outcomes), (n, len(outcomes)))
    values = []
    for row in draws:
        c = curve(trigger, [outcomes[i] for i in row])
        values.append(
            c.area - (c.random_area if reference is None else curve("reference", [reference[i] for i in row]).area)
        )
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def curves(
    lines: Iterable[dict[str, Any]],
    triggers: Sequence[str],
    bootstrap: int = 0,
    seed: int = 0,
    kinds: dict[str, str] | None = None,
) -> dict[str, Curve]:
    """Every trigger's curve over the stored sweep lines (see :func:`outcome_from_json`), with the interval of its
    area minus random from ``bootstrap`` resamples of the questions (none for 0). With the triggers' ``kinds``
    (``baseline`` = training-free), each other trigger's area is also compared with the best training-free one's."""
    lines = list(lines)
    outcomes = {t: [outcome_from_json(line, t) for line in lines] for t in triggers}
    out = {t: curve(t, o) for t, o in outcomes.items()}
    if bootstrap:
        out = {
            t: dataclasses.replace(c, interval=area_interval(t, outcomes[t], bootstrap, seed)) for t, c in out.items()
        }
    free = [t for t in triggers if (kinds or {}).get(t) == "baseline"]
    if free and bootstrap:
        best = max(free, key=lambda t: out[t].area)
        for t in triggers:
            interval = (0.0, 0.0) if t == best else area_interval(t, outcomes[t], bootstrap, seed, outcomes[best])
            out[t] = dataclasses.replace(
                out[t], best_free=best, over_best_free=out[t].area - out[best].area, over_best_free_interval=interval
            )
    return out


def sweep_line(
    events: dict[str, list[tuple[float, int]]], never_answer: str, answers_at: dict[int, str], references: list[str]
) -> dict[str, Any]:
    """One question of the sweep as stored: each trigger's events, the no-retrieval answer and the answers after a
    retrieval at each position, with their correctness (containment)."""
    return {
        "events": {t: [[s, p] for s, p in e] for t, e in events.items()},
        "never_answer": never_answer,
        "never": bool(accuracy(never_answer, references)),
        "answers": {str(p): a for p, a in answers_at.items()},
        "at": {str(p): bool(accuracy(a, references)) for p, a in answers_at.items()},
    }


def trace_events(trace) -> dict[str, list[tuple[float, int]]]:
    """Each trigger's events from a no-retrieval trace: question triggers one event at position 0 (none for a NaN
    score), token triggers the records of their token scores (see :func:`records`)."""
    events = {t: ([] if math.isnan(s) else [(float(s), 0)]) for t, s in trace.question_scores.items()}
    events.update({t: records(s, trace.truncate.get(t, "token")) for t, s in trace.token_scores.items()})
    return events
