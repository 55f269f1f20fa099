"""Models-from-code entry point of a registered detector (MLflow executes this file, never a pickle).

Only MLflow should import it: it declares the model with ``mlflow.models.set_model``. In-process
(``mlflow.pyfunc.load_model(...).predict``) and served over HTTP (``mlflow models serve -m models:/<name>@<alias>
--env-manager local``) alike, a frame is first checked against the pyfunc's input signature by MLflow (a missing
column) and then against the detector's declared inputs (a missing or bad value: :class:`PredictInputError`, an HTTP 400
with that message when served). The LLM is loaded on the first prediction, from where the artifact says it came from.
"""

from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from detectors.errors import InputError
from detectors.registry.kinds import load_artifact


class PredictInputError(MlflowException, InputError):
    """Bad input to the pyfunc: an :class:`~detectors.errors.InputError` that MLflow's scoring server answers with HTTP
    400
    and its message (it answers any other exception with a generic message and a traceback)."""


class DetectorModel(mlflow.pyfunc.PythonModel):
    """pyfunc view of any detector: its ``predict_frame`` on the input frame."""

    def load_context(self, context) -> None:
        self.detector = load_artifact(context.artifacts["detector"])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        try:
            return self.detector.predict_frame(model_input)
        except InputError as err:
            raise PredictInputError(str(err), error_code=INVALID_PARAMETER_VALUE) from err


mlflow.models.set_model(DetectorModel())
