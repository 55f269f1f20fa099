"""CtrlA's layer ranges: the paper's range scaled to the LLM's depth, and a window of layers chosen on validation.

CtrlA steers at layers 5-18 and monitors at layers 10-25 of 32-layer 7B models (App. C.4), ranges
found empirically for those models. :func:`resolve_range` scales them to another depth;
:func:`choose_window` instead picks, among all contiguous windows of a given width, the one whose
layer-pooled score (the steering/monitoring pooling: the mean projection over the window's layers)
separates the validation examples best (highest AUROC). The same rule serves honesty (validation
true/false statements) and confidence (validation answers of the early set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from detectors.config.schema import LayerRangeParams
from detectors.errors import InputError

RANGES = ("paper", "validation")  # the two layer ranges evaluate_directions reports and register_ctrla chooses from


def resolve_range(spec: LayerRangeParams, num_layers: int) -> list[int]:
    """CtrlA's layer range (given for a ``reference_layers``-deep LLM) scaled to this LLM's depth, 1-based."""
    first = min(max(1, round(spec.first * num_layers / spec.reference_layers)), num_layers)
    last = min(max(first, round(spec.last * num_layers / spec.reference_layers)), num_layers)
    return list(range(first, last + 1))


@dataclasses.dataclass(frozen=True)
class WindowChoice:
    """The chosen window (1-based layers), its validation AUROC, and every window's (by first layer)."""

    layers: list[int]
    val_auroc: float | None
    by_first_layer: dict[int, float | None]


def choose_window(
    val_auroc: Callable[[list[int]], float | None], num_layers: int, width: int, key: str = "width"
) -> WindowChoice:
    """The contiguous window of ``width`` layers with the highest ``val_auroc(window)`` (the earliest on ties).

    ``val_auroc`` returns None where it is undefined (one class only); then no window can be chosen and
    the result has ``val_auroc`` None and the first window. ``key`` names the width's setting in errors.
    """
    if not 1 <= width <= num_layers:
        raise InputError(
            f"{key} = {width}, but the LLM has {num_layers} layers: choose a width in 1..{num_layers} (null = the "
            f"paper range's)"
        )
    by_first = {first: val_auroc(list(range(first, first + width))) for first in range(1, num_layers - width + 2)}
    scored = {first: a for first, a in by_first.items() if a is not None}
    best = max(scored, key=lambda first: (scored[first], -first)) if scored else 1
    return WindowChoice(list(range(best, best + width)), scored.get(best), by_first)
