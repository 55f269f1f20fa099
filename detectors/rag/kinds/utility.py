"""The retrieval-utility trigger: the corpus's trained retrieval decision before generating, and its gate on the
passages."""

from __future__ import annotations

from detectors.evaluation.scorers import DetectorScorer
from detectors.rag.controllers.gate import Gated
from detectors.rag.kinds.early import EarlyCalculator
from detectors.rag.triggers import PROBABILITY, Policy, Trigger
from detectors.utility.detector import UtilityGate


def build(name: str, detector, settings: object) -> Trigger:
    return Trigger(
        name,
        DetectorScorer(name, detector),
        float(detector.threshold),
        Policy("question"),
        (EarlyCalculator(detector),),
        PROBABILITY,
        controller=Gated(UtilityGate(detector)),
    )
