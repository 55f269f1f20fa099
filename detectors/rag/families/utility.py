"""The retrieval-utility trigger: the corpus's trained retrieval decision before generating, and its gate on the
passages."""

from __future__ import annotations

from detectors.evaluation.scorers import DetectorScorer
from detectors.rag.controllers.gate import Gated
from detectors.rag.families.early import EarlyCalculator
from detectors.rag.triggers import PROBABILITY, Policy, Trigger, TriggerContext, TriggerEntry
from detectors.utility.detector import UtilityGate


def build(context: TriggerContext, settings: None) -> Trigger:
    name, detector = context.name, context.detector
    return Trigger(
        name,
        DetectorScorer(name, detector),
        float(detector.threshold),
        Policy("question"),
        (EarlyCalculator(detector),),
        PROBABILITY,
        controller=Gated(UtilityGate(detector)),
    )


UTILITY = TriggerEntry(build)
