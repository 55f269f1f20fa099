"""The retrieval triggers, one module per family: its builder(s) (registered by name in
:data:`detectors.rag.triggers.TRAINING_FREE` and :data:`~detectors.rag.triggers.DETECTOR_KINDS`) and the calculators of the
statistics it reads. A configuration of the loop depends on the modules of its own triggers only, so changing one
family's code reruns only the configurations that use it (rag_eval's runs are keyed on their code)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from detectors.errors import InputError
from detectors.lazy import LazyRegistry
from detectors.rag.triggers import Trigger, TriggerSettings

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

# name -> builder(llm, threshold, spacy model, settings); the ones with a threshold take it from rag_eval.thresholds
TRAINING_FREE = LazyRegistry(
    "training-free trigger",
    {
        "always": "detectors.rag.kinds.always:build",
        "flare": "detectors.rag.kinds.flare:build",
        "rind": "detectors.rag.kinds.rind:build",
        "sit_min": "detectors.rag.kinds.sit:build_min",
        "sit": "detectors.rag.kinds.sit:build",
        "entropy_mean": "detectors.rag.kinds.entropy:build_mean",
        "entropy_max": "detectors.rag.kinds.entropy:build_max",
    },
)
# registered detector kind -> builder(name, detector attached to the loop's LLM, settings)
DETECTOR_KINDS = LazyRegistry(
    "trigger kind of a registered detector",
    {
        "dior-early": "detectors.rag.kinds.dior:early",
        "dior-realtime": "detectors.rag.kinds.dior:realtime",
        "ctrla-confidence": "detectors.rag.kinds.ctrla:build",
        "utility": "detectors.rag.kinds.utility:build",
    },
)


def check_specs(specs: list[str]) -> None:
    """Every configured trigger is a training-free one or ``<name>@<alias>`` (a clear error naming the known ones
    otherwise): checked before any work, the registered ones when they load."""
    for spec in specs:
        if "@" not in spec and spec not in TRAINING_FREE:
            raise InputError(
                f"trigger {spec!r}: name one of {', '.join(TRAINING_FREE)} or a registered detector as <name>@<alias>"
            )


def make_trigger(
    spec: str,
    llm: LLM,
    thresholds: dict[str, float] | None,
    spacy_model: str,
    tracking_uri: str | None = None,
    settings: TriggerSettings | None = None,
) -> Trigger:
    """The trigger named ``spec``: one of :data:`TRAINING_FREE` (its threshold from ``thresholds``; None: +inf, to be
    set later, as a sweep does) or ``<registered model>@<alias>`` loaded with :func:`detectors.load_detector` (from
    ``tracking_uri``) onto ``llm``; the detector's kind decides the trigger, and a detector built with another LLM is
    refused by its fingerprint. ``settings``: what the ``sit`` and CtrlA triggers read beyond a threshold."""
    settings = settings or TriggerSettings()
    check_specs([spec])
    if spec in TRAINING_FREE:
        if thresholds is not None and spec != "always" and spec not in thresholds:
            raise InputError(
                f"trigger {spec!r} has no threshold: give rag_eval.thresholds.{spec} (a number or `validation`)"
            )
        trigger = TRAINING_FREE.load(spec)(
            llm, math.inf if thresholds is None else thresholds.get(spec), spacy_model, settings
        )
        trigger.source = TRAINING_FREE.module(spec)
        return trigger
    name, alias = spec.split("@", 1)
    from detectors.inference import load_detector

    detector = load_detector(
        name, alias=alias, llm=llm, tracking_uri=tracking_uri
    )  # not registered: NotRegisteredError, an InputError
    if detector.KIND not in DETECTOR_KINDS:
        raise InputError(
            f"trigger {spec!r}: a {detector.KIND!r} detector does not decide retrieval (use one of {', '.join(DETECTOR_KINDS)})"
        )
    trigger = DETECTOR_KINDS.load(detector.KIND)(name, detector, settings)
    trigger.source, trigger.detector = DETECTOR_KINDS.module(detector.KIND), detector
    return trigger
