"""The registered detector kinds: the ``kind`` written in an artifact's ``detector.json`` names the class
that loads it. Each class is imported only when its kind is loaded."""

from __future__ import annotations

from pathlib import Path

from detectors.interfaces import Detector
from detectors.registry.artifact import read_config


def detector_class(kind: str) -> type[Detector]:
    if kind == "dior-early":
        from detectors.dior.early_detector import EarlyDetector

        return EarlyDetector
    if kind == "dior-realtime":
        from detectors.dior.realtime_detector import RealtimeDetector

        return RealtimeDetector
    if kind == "ctrla-honesty":
        from detectors.ctrla.detectors import HonestySteering

        return HonestySteering
    if kind == "ctrla-confidence":
        from detectors.ctrla.detectors import ConfidenceDetector

        return ConfidenceDetector
    if kind == "utility":
        from detectors.utility.detector import UtilityDetector

        return UtilityDetector
    raise ValueError(f"no detector kind {kind!r}; known kinds: {list(KINDS)}")


KINDS = ("dior-early", "dior-realtime", "ctrla-honesty", "ctrla-confidence", "utility")


def load_artifact(directory: str | Path) -> Detector:
    """The detector stored in ``directory``, whatever its kind."""
    kind = read_config(directory).get("kind")
    if kind not in KINDS:
        raise ValueError(f"{directory} holds a detector of kind {kind!r}; known kinds: {list(KINDS)}")
    return detector_class(kind).load(directory)
