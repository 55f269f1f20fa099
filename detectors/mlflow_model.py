"""Models-from-code entry point of a registered detector (MLflow loads this file, not a pickle).

The artifact directory's ``detector.json`` names its ``kind``; ``KINDS`` maps each kind to the class
that loads it. Every such class has ``load(directory)`` and ``predict_frame(frame) -> frame``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import mlflow
import pandas as pd

from detectors.artifact import read_config

KINDS = {
    "dior-early": "detectors.early_detector:EarlyDetector",
    "dior-realtime": "detectors.realtime_detector:RealtimeDetector",
    "ctrla-honesty": "detectors.ctrla:HonestySteering",
    "ctrla-confidence": "detectors.ctrla:ConfidenceDetector",
}


def load_artifact(directory: str | Path):
    """The detector stored in ``directory``, whatever its kind."""
    kind = read_config(directory).get("kind")
    if kind not in KINDS:
        raise ValueError(f"{directory} holds a detector of kind {kind!r}; known kinds: {sorted(KINDS)}")
    module, cls = KINDS[kind].split(":")
    return getattr(importlib.import_module(module), cls).load(directory)


class DetectorModel(mlflow.pyfunc.PythonModel):
    """pyfunc view of any detector: its ``predict_frame`` on the input frame."""

    def load_context(self, context) -> None:
        self.detector = load_artifact(context.artifacts["detector"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        return self.detector.predict_frame(model_input)


mlflow.models.set_model(DetectorModel())
