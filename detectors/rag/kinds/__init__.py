"""The retrieval triggers, one module per family: its builder(s) (registered by name in
:data:`detectors.extensions.TRAINING_FREE` and :data:`~detectors.extensions.DETECTOR_KINDS`) and the calculators of the
statistics it reads. A configuration of the loop depends on the modules of its own triggers only, so changing one
family's code reruns only the configurations that use it (rag_eval's runs are keyed on their code)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from detectors.errors import InputError
from detectors.extensions import DETECTOR_KINDS, TRAINING_FREE
from detectors.rag.triggers import Trigger, TriggerSettings

if TYPE_CHECKING:
    from detectors.llm.loading import LLM


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
    if "@" not in spec:  # a training-free trigger
        build = TRAINING_FREE.load(spec)  # an unknown name: an InputError listing the known ones
        if thresholds is not None and spec != "always" and spec not in thresholds:
            raise InputError(
                f"trigger {spec!r} has no threshold: give rag_eval.thresholds.{spec} (a number or `validation`)"
            )
        trigger = build(llm, math.inf if thresholds is None else thresholds.get(spec), spacy_model, settings)
        trigger.source = TRAINING_FREE.module(spec)
        return trigger
    name, alias = spec.split("@", 1)
    from detectors.inference import load_detector

    # not registered: NotRegisteredError, an InputError
    detector = load_detector(name, alias=alias, llm=llm, tracking_uri=tracking_uri)
    if detector.KIND not in DETECTOR_KINDS:
        raise InputError(
            f"trigger {spec!r}: a {detector.KIND!r} detector does not decide retrieval (use one of "
            f"{', '.join(DETECTOR_KINDS)})"
        )
    trigger = DETECTOR_KINDS.load(detector.KIND)(name, detector, settings)
    trigger.source, trigger.detector = DETECTOR_KINDS.module(detector.KIND), detector
    return trigger
