"""Models-from-code entry point of a registered detector (MLflow executes this file, never a pickle).

Only MLflow should import it: it declares the model with ``mlflow.models.set_model``.
"""

from __future__ import annotations

import mlflow
import pandas as pd

from detectors.registry.kinds import load_artifact


class DetectorModel(mlflow.pyfunc.PythonModel):
    """pyfunc view of any detector: its ``predict_frame`` on the input frame."""

    def load_context(self, context) -> None:
        self.detector = load_artifact(context.artifacts["detector"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        return self.detector.predict_frame(model_input)


mlflow.models.set_model(DetectorModel())
