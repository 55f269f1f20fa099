"""The real-time detector as it is served: ``monitor`` fires on the first generated token of ANY kind whose
probability reaches the detector's threshold, not only on the entity tokens it is evaluated on.

- :class:`ServedMax` (``mlp[served]``) scores a continuation by the max of the MLP's probability over all its
  generated tokens: the served detector fires on a continuation exactly when that max reaches its threshold.
- :func:`served_auroc` is that score's continuation-level AUROC on one split (``train_realtime`` chooses what to
  train on by it, on validation).
- :func:`served_behaviour` says where and how often the served detector fires on a split's records.

``mlp_scores`` is :meth:`~detectors.dior.realtime_detector.RealtimeDetector.record_scores`' output: per record
id, the probability of every generated token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from detectors.errors import InputError
from detectors.evaluation.metrics import auroc, choose_threshold, require_both_classes
from detectors.evaluation.scorers import TokenStatScorer, seed_stat
from detectors.interfaces import Level
from detectors.sources.ids import ok_records

SERVED = "mlp[served]"


@dataclasses.dataclass(frozen=True)
class ServedMax(TokenStatScorer):
    """A continuation's max over all its generated tokens of the per-token stat ``mlp``; with the detector's
    threshold, the served decision "some token fires"."""

    level: Level = Level.CONTINUATION
    name: str = SERVED
    stat: str = "mlp"
    levels: tuple[Level, ...] = (Level.CONTINUATION,)
    kind: str = "detector"

    def continuation(self, stats: dict[str, np.ndarray], entities: list[np.ndarray]) -> float:
        return float(np.max(stats[self.stat]))


def served_scorer(threshold: float, seeds: tuple[int, ...] = ()) -> ServedMax:
    """``mlp[served]`` with the detector's own threshold (the one ``monitor``/``stop_on_trigger`` apply); ``seeds``:
    those of its ensemble, each served alone from its own stat (:func:`~detectors.evaluation.scorers.seed_stat`)."""
    members = tuple(ServedMax(name=seed_stat(SERVED, s), stat=seed_stat("mlp", s)) for s in seeds)
    return ServedMax(threshold=threshold, seeds=members)


def record_tokens(
    frame: pd.DataFrame, mlp_scores: dict[str, np.ndarray], split: str | None
) -> list[tuple[Any, np.ndarray, np.ndarray]]:
    """``(row, scores, token labels)`` of the ok records of ``split`` (None: all), every token scored."""
    ok = ok_records(frame, split)
    if not len(ok):
        raise InputError(f"no ok record in split {split!r} of the real-time set: nothing to serve")
    out = []
    for row in ok.itertuples():
        if row.id not in mlp_scores:
            raise InputError(
                f"record {row.id!r} has no detector scores: score the same frame with RealtimeDetector.record_scores"
            )
        scores, labels = np.asarray(mlp_scores[row.id], dtype=np.float64), np.asarray(row.token_label)
        if len(scores) != len(labels) or np.isnan(scores).any():
            raise InputError(
                f"record {row.id!r}: {int((~np.isnan(scores)).sum())} scored tokens of {len(labels)} generated; the "
                f"served view "
                "needs every generated token scored (RealtimeDetector.record_scores scores them all)"
            )
        out.append((row, scores, labels))
    return out


def continuation_maxima(
    frame: pd.DataFrame, mlp_scores: dict[str, np.ndarray], split: str
) -> tuple[np.ndarray, np.ndarray]:
    """The continuation labels of ``split`` and each continuation's served score, the max over its generated tokens."""
    records = record_tokens(frame, mlp_scores, split)
    return np.array([int(row.label) for row, _, _ in records]), np.array([scores.max() for _, scores, _ in records])


def served_auroc(frame: pd.DataFrame, mlp_scores: dict[str, np.ndarray], split: str) -> float:
    """Continuation-level AUROC on ``split`` of the max over all generated tokens (``mlp[served]``)."""
    labels, maxima = continuation_maxima(frame, mlp_scores, split)
    require_both_classes(labels, f"the {split} split's continuations")
    return auroc(labels, maxima)


def served_threshold(frame: pd.DataFrame, mlp_scores: dict[str, np.ndarray], strategy: str) -> float:
    """The threshold ``monitor()`` should fire at, chosen (``youden`` | ``f1``) on the validation continuations by the
    max over all their generated tokens: serving fires at the first token that reaches it, i.e. when that max does."""
    return choose_threshold(*continuation_maxima(frame, mlp_scores, "val"), strategy)


def _share(count: int, n: int) -> float | None:
    return count / n if n else None


def served_behaviour(
    frame: pd.DataFrame, mlp_scores: dict[str, np.ndarray], threshold: float, split: str | None = "test"
) -> dict:
    """Where the served detector fires on the ok records of ``split``, at ``threshold``.

    - ``trigger_rate``: share of continuations where some generated token reaches the threshold (also per class);
    - ``trigger_before`` / ``trigger_at`` / ``trigger_after`` / ``never_triggered``: shares of the hallucinated
      continuations (they sum to 1) by where the first trigger stands relative to the first token of the first
      hallucinated entity; ``median_trigger_offset``: median of (first trigger - that token) in tokens over the
      triggered ones (negative: it fired earlier);
    - ``false_trigger_rate_non_entity`` / ``false_trigger_rate_supported_entity``: share of the non-entity tokens,
      and of the supported entities' tokens, at or above the threshold; ``hit_rate_hallucinated_entity``: the
      same share of the hallucinated entities' tokens.

    A share over no unit (no hallucinated continuation, say) is None.
    """
    records = record_tokens(frame, mlp_scores, split)
    fired, offsets = {0: 0, 1: 0}, []
    n = {0: 0, 1: 0}
    tokens = {label: [0, 0] for label in (-1, 0, 1)}  # token label -> [at or above the threshold, all]
    for row, scores, labels in records:
        hits = scores >= threshold
        label = int(row.label)
        n[label] += 1
        fired[label] += int(hits.any())
        for token_label, count in tokens.items():
            mask = labels == token_label
            count[0] += int(hits[mask].sum())
            count[1] += int(mask.sum())
        if label and hits.any():
            offsets.append(int(np.argmax(hits)) - int(np.argmax(labels == 1)))
    offsets_arr, n_h = np.asarray(offsets), n[1]
    return {
        "threshold": float(threshold),
        "n_continuations": n[0] + n[1],
        "n_hallucinated": n_h,
        "trigger_rate": _share(fired[0] + fired[1], n[0] + n[1]),
        "trigger_rate_hallucinated": _share(fired[1], n_h),
        "trigger_rate_correct": _share(fired[0], n[0]),
        "trigger_before": _share(int((offsets_arr < 0).sum()), n_h),
        "trigger_at": _share(int((offsets_arr == 0).sum()), n_h),
        "trigger_after": _share(int((offsets_arr > 0).sum()), n_h),
        "never_triggered": _share(n_h - len(offsets), n_h),
        "median_trigger_offset": float(np.median(offsets_arr)) if len(offsets) else None,
        "false_trigger_rate_non_entity": _share(*tokens[-1]),
        "false_trigger_rate_supported_entity": _share(*tokens[0]),
        "hit_rate_hallucinated_entity": _share(*tokens[1]),
        "n_non_entity_tokens": tokens[-1][1],
        "n_supported_entity_tokens": tokens[0][1],
        "n_hallucinated_entity_tokens": tokens[1][1],
    }
