"""CtrlA's layer ranges: the paper's range scaled to the LLM's depth, and a window of layers chosen on validation.

CtrlA steers at layers 5-18 and monitors at layers 10-25 of 32-layer 7B models (App. C.4), ranges
found empirically for those models. :func:`resolve_range` scales them to another depth;
:func:`choose_window` compares every contiguous window of a given width with it on validation, by the rule every
validation choice follows (:mod:`detectors.evaluation.choice`): the paper's range stays unless a window's
layer-pooled score (the steering/monitoring pooling: the mean projection over the window's layers) separates the
validation examples better by a paired 95 % bootstrap interval of the AUROC above 0. The same rule serves honesty
(validation true/false statements) and confidence (validation answers of the early set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from detectors.config.schema import LayerRangeParams
from detectors.errors import InputError
from detectors.evaluation.choice import auroc_deltas, choose, family_level
from detectors.evaluation.metrics import auroc

RANGES = ("paper", "validation")  # the two layer ranges evaluate_directions reports and register_ctrla chooses from


def resolve_range(spec: LayerRangeParams, num_layers: int) -> list[int]:
    """CtrlA's layer range (given for a ``reference_layers``-deep LLM) scaled to this LLM's depth, 1-based."""
    first = min(max(1, round(spec.first * num_layers / spec.reference_layers)), num_layers)
    last = min(max(first, round(spec.last * num_layers / spec.reference_layers)), num_layers)
    return list(range(first, last + 1))


@dataclasses.dataclass(frozen=True)
class WindowChoice:
    """The chosen layers (1-based), their validation AUROC, every window's (by first layer), and the rule's record
    (:meth:`~detectors.evaluation.choice.Choice.as_dict`; None when no window could be compared: one class only)."""

    layers: list[int]
    val_auroc: float | None
    by_first_layer: dict[int, float | None]
    choice: dict | None = None


def window_name(layers: list[int]) -> str:
    """A window as the choice names it: ``"5-17"``."""
    return f"{layers[0]}-{layers[-1]}"


def choose_window(
    scores: Callable[[list[int]], np.ndarray],
    labels: np.ndarray,
    default: list[int],
    num_layers: int,
    width: int,
    key: str = "width",
) -> WindowChoice:
    """The window the rule keeps: ``default`` (the paper's range, of any width) unless a contiguous window of
    ``width`` layers has a validation AUROC of ``scores(window)`` (one score per validation example, ``labels`` theirs)
    higher by a paired bootstrap interval above 0 (each at the :func:`~detectors.evaluation.choice.family_level` of the
    windows, so that noise moves the default less than 5 % of the time however many there are); among several, the
    most surely better.

    With one class in ``labels`` nothing can be compared: the default, ``val_auroc`` None and no choice. ``key`` names
    the width's setting in errors.
    """
    if not 1 <= width <= num_layers:
        raise InputError(
            f"{key} = {width}, but the LLM has {num_layers} layers: choose a width in 1..{num_layers} (null = the "
            f"paper range's)"
        )
    labels = np.asarray(labels)
    windows = [list(range(first, first + width)) for first in range(1, num_layers - width + 2)]
    if len(labels) == 0 or labels.min() == labels.max():
        return WindowChoice(list(default), None, {w[0]: None for w in windows})
    pooled = {window_name(w): np.asarray(scores(w), dtype=np.float64) for w in [default, *windows]}
    aurocs = {name: auroc(labels, s) for name, s in pooled.items()}
    level = family_level(len(windows))
    choice = choose(
        window_name(default), auroc_deltas(labels, pooled, window_name(default), level=level), len(labels), level
    )
    chosen = default if not choice.moved else next(w for w in windows if window_name(w) == choice.chosen)
    return WindowChoice(
        list(chosen), aurocs[choice.chosen], {w[0]: aurocs[window_name(w)] for w in windows}, choice.as_dict()
    )
