"""Models-from-code entry point of a registered detector (MLflow loads this file, not a pickle)."""

from __future__ import annotations

import mlflow
import pandas as pd

from detectors.early_detector import EarlyDetector


class EarlyDetectorModel(mlflow.pyfunc.PythonModel):
    """pyfunc view of the early detector: a ``question`` column in, probability/retrieve/keywords out."""

    def load_context(self, context) -> None:
        self.detector = EarlyDetector.load(context.artifacts["detector"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        decisions = [self.detector.assess(str(q)) for q in model_input["question"]]
        return pd.DataFrame(
            {
                "probability": [d.probability for d in decisions],
                "retrieve": [d.retrieve for d in decisions],
                "keywords": [d.keywords for d in decisions],
            }
        )


mlflow.models.set_model(EarlyDetectorModel())
