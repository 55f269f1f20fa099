"""Choices made on validation data that noise cannot flip: a fixed default, left only for a candidate that beats it by
a paired 95 % bootstrap interval wholly above 0 on the same validation units.

Every choice the pipeline makes on validation (a detector's training candidate, a layer window, the champion move,
a RAG configuration's operating point) goes through :func:`choose`; the measures are the paired differences of
:mod:`detectors.evaluation.bootstrap` (:func:`auroc_deltas` for scorers, :func:`mean_deltas` for per-unit outcomes such
as a question's correctness). A candidate whose interval includes 0 is *level with* the default and is reported as a
tie; among candidates whose interval is above 0 the one with the highest lower bound wins (the most surely better),
then the higher difference, then the earlier candidate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from detectors.evaluation.bootstrap import paired_bootstrap_delta, paired_mean_delta

Delta = tuple[float, float, float]  # candidate minus default: the point difference and its paired 95 % interval


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided and why."""

    chosen: str
    default: str
    deltas: dict[str, Delta]  # every candidate against the default
    ties: tuple[str, ...]  # candidates level with the default (interval includes 0, or no interval)
    better: tuple[str, ...]  # candidates above the default (interval above 0), best first
    worse: tuple[str, ...]  # candidates below the default (interval below 0)
    units: int  # validation units the differences were measured on

    @property
    def moved(self) -> bool:
        return self.chosen != self.default

    def as_dict(self) -> dict:
        """A JSON-able record of the choice (metrics files, MLflow tags)."""
        return {
            "chosen": self.chosen,
            "default": self.default,
            "rule": "the default unless a candidate beats it by a paired 95% bootstrap interval above 0",
            "units": self.units,
            "deltas": {k: [_round(v) for v in d] for k, d in self.deltas.items()},
            "ties": list(self.ties),
            "better": list(self.better),
            "worse": list(self.worse),
        }


def _round(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 5)


def choose(default: str, deltas: Mapping[str, Delta], units: int) -> Choice:
    """The default, or the candidate of ``deltas`` (each: its difference to the default and the paired interval) that
    beats it surely: lower bound above 0; among several, the highest lower bound. ``units``: how many validation
    units (questions, answers, tokens) the differences were measured on, recorded with the choice."""
    deltas = {k: tuple(float(x) for x in v) for k, v in deltas.items() if k != default}
    better = sorted(
        (k for k, (_, low, _) in deltas.items() if math.isfinite(low) and low > 0),
        key=lambda k: (-deltas[k][1], -deltas[k][0], list(deltas).index(k)),
    )
    worse = [k for k, (_, _, high) in deltas.items() if math.isfinite(high) and high < 0]
    ties = [k for k in deltas if k not in better and k not in worse]
    return Choice(better[0] if better else default, default, deltas, tuple(ties), tuple(better), tuple(worse), units)


def auroc_deltas(
    labels: Sequence[int],
    scores: Mapping[str, Sequence[float]],
    default: str,
    groups: Sequence | None = None,
    n: int = 1000,
    seed: int = 0,
) -> dict[str, Delta]:
    """AUROC of each scorer of ``scores`` minus the default's, on the same units (``groups``: the clusters resampled
    together, e.g. a continuation's tokens), with paired intervals."""
    ref = np.asarray(scores[default], dtype=np.float64)
    return {
        name: paired_bootstrap_delta(labels, np.asarray(s, dtype=np.float64), ref, groups, n, seed)
        for name, s in scores.items()
        if name != default
    }


def mean_deltas(values: Mapping[str, Sequence[float]], default: str, n: int = 1000, seed: int = 0) -> dict[str, Delta]:
    """Mean of each candidate's per-unit values (a question's correctness, say) minus the default's, on the same
    units, with paired intervals."""
    return {name: paired_mean_delta(v, values[default], n, seed) for name, v in values.items() if name != default}
