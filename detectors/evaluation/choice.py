"""Choices made on validation data that noise cannot flip: a fixed default, left only for a candidate that beats it by
a paired 95 % bootstrap interval wholly above 0 on the same validation units.

Every choice the pipeline makes on validation (a detector's training candidate, a layer window, the champion move,
a RAG configuration's operating point) goes through :func:`choose`; the measures are the paired differences of
:mod:`detectors.evaluation.bootstrap` (:func:`auroc_deltas` for scorers, :func:`mean_deltas` for per-unit outcomes such
as a question's correctness). A candidate whose interval includes 0 is *level with* the default and is reported as a
tie; among candidates whose interval is above 0 the one with the highest lower bound wins (the most surely better),
then the higher difference, then the earlier candidate.

With many candidates (every layer window, say) one of them beats the default by chance more often than one alone
would: :func:`family_level` gives the level of each interval that keeps the chance that noise moves the default under
5 % whatever their number (Bonferroni), and :func:`auroc_deltas` and :func:`mean_deltas` take it as ``level``.
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
    level: float = 0.95  # of each candidate's interval (:func:`family_level` of several)

    @property
    def moved(self) -> bool:
        return self.chosen != self.default

    def as_dict(self) -> dict:
        """A JSON-able record of the choice (metrics files, MLflow tags)."""
        return {
            "chosen": self.chosen,
            "default": self.default,
            "rule": f"the default unless a candidate beats it by a paired {100 * self.level:.3g} % bootstrap interval "
            "above 0",
            "units": self.units,
            "level": self.level,
            "deltas": {k: [_round(v) for v in d] for k, d in self.deltas.items()},
            "ties": list(self.ties),
            "better": list(self.better),
            "worse": list(self.worse),
        }


def _round(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 5)


def family_level(candidates: int, level: float = 0.95) -> float:
    """The level of each of ``candidates`` intervals that keeps the chance that any of them is above 0 by noise alone
    under ``1 - level`` (Bonferroni): 0.95 for one candidate, 0.9833 for three, 0.9969 for sixteen."""
    return 1 - (1 - level) / max(int(candidates), 1)


def choose(default: str, deltas: Mapping[str, Delta], units: int, level: float = 0.95) -> Choice:
    """The default, or the candidate of ``deltas`` (each: its difference to the default and the paired interval) that
    beats it surely: lower bound above 0; among several, the highest lower bound. ``units``: how many validation
    units (questions, answers, tokens) the differences were measured on; ``level``: the intervals' (as computed);
    both recorded with the choice."""
    deltas = {k: tuple(float(x) for x in v) for k, v in deltas.items() if k != default}
    better = sorted(
        (k for k, (_, low, _) in deltas.items() if math.isfinite(low) and low > 0),
        key=lambda k: (-deltas[k][1], -deltas[k][0], list(deltas).index(k)),
    )
    worse = [k for k, (_, _, high) in deltas.items() if math.isfinite(high) and high < 0]
    ties = [k for k in deltas if k not in better and k not in worse]
    chosen = better[0] if better else default
    return Choice(chosen, default, deltas, tuple(ties), tuple(better), tuple(worse), units, level)


def auroc_deltas(
    labels: Sequence[int],
    scores: Mapping[str, Sequence[float]],
    default: str,
    groups: Sequence | None = None,
    n: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Delta]:
    """AUROC of each scorer of ``scores`` minus the default's, on the same units (``groups``: the clusters resampled
    together, e.g. a continuation's tokens), with paired intervals at ``level``."""
    ref = np.asarray(scores[default], dtype=np.float64)
    return {
        name: paired_bootstrap_delta(labels, np.asarray(s, dtype=np.float64), ref, groups, n, seed, level=level)
        for name, s in scores.items()
        if name != default
    }


def mean_deltas(
    values: Mapping[str, Sequence[float]], default: str, n: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, Delta]:
    """Mean of each candidate's per-unit values (a question's correctness, say) minus the default's, on the same
    units, with paired intervals at ``level``."""
    return {
        name: paired_mean_delta(v, values[default], n, seed, level) for name, v in values.items() if name != default
    }


def scored_units(ids: Sequence, labels: Sequence[int], scores: Sequence[float]) -> dict[str, list]:
    """A JSON-able record of validation units and one scorer's scores of them (``ids``, ``labels``, ``scores``): what a
    trained detector keeps of its validation, so that a later version can be compared with it on the same units
    (:func:`versus`)."""
    if not len(ids) == len(labels) == len(scores):
        raise ValueError(f"{len(ids)} ids, {len(labels)} labels and {len(scores)} scores: one of each per unit")
    return {
        "ids": [str(i) for i in ids],
        "labels": [int(y) for y in labels],
        "scores": [float(s) for s in scores],
    }


def versus(
    default: Mapping[str, list], candidate: Mapping[str, list], names: tuple[str, str] = ("default", "candidate")
) -> Choice | None:
    """:func:`choose` between two scorers' :func:`scored_units` by their AUROC: ``names[1]`` replaces ``names[0]`` only
    when it is surely better on the same units. None when the records do not hold the same units with the same labels
    (nothing to pair)."""
    first, second = (dict(zip(r["ids"], zip(r["labels"], r["scores"]))) for r in (default, candidate))
    if set(first) != set(second) or len(first) != len(default["ids"]) or not first:
        return None
    ids = sorted(first)
    labels = [first[i][0] for i in ids]
    if labels != [second[i][0] for i in ids] or len(set(labels)) < 2:
        return None
    scores = {names[0]: [first[i][1] for i in ids], names[1]: [second[i][1] for i in ids]}
    return choose(names[0], auroc_deltas(labels, scores, names[0]), units=len(ids))


def choice_tags(prefix: str, record: Mapping | None) -> dict[str, str]:
    """A choice's record (:meth:`Choice.as_dict`) as MLflow tags under ``prefix``: what was chosen, the default, the
    ties, the candidates surely better and worse, and the units it rests on (none for no record)."""
    if not record:
        return {}
    return {
        f"{prefix}.chosen": str(record["chosen"]),
        f"{prefix}.default": str(record["default"]),
        f"{prefix}.ties": ", ".join(map(str, record["ties"])) or "none",
        f"{prefix}.better": ", ".join(map(str, record["better"])) or "none",
        f"{prefix}.worse": ", ".join(map(str, record["worse"])) or "none",
        f"{prefix}.units": str(record["units"]),
    }
