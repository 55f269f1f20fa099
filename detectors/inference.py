"""Thin inference API: load a registered detector and ask it "retrieve now?".

    from detectors import load_detector
    det = load_detector("dior-early", alias="champion")      # loads its LLM from the recorded source
    decision = det.assess("The capital of Occitania is")
    decision.retrieve, decision.probability, decision.keywords

Every registered kind loads the same way (see ``detectors.registry.kinds``) and is a
:class:`detectors.interfaces.Detector`.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow

from detectors.interfaces import Detector
from detectors.llm.loading import LLM
from detectors.registry.store import configure, configure_params


def load_detector(
    name: str = "dior-early",
    alias: str = "champion",
    *,
    tracking_uri: str | None = None,
    params: str | Path | None = None,
    llm: LLM | None = None,
    allow_dtype_mismatch: bool = False,
) -> Detector:
    """The detector registered as ``models:/<name>@<alias>``.

    The tracking store is ``tracking_uri``, else the ``mlflow`` section of ``params`` when given, else
    ``$MLFLOW_TRACKING_URI`` (which ``mlflow.set_tracking_uri`` also sets, so an explicit ``params`` must win
    over it), else the ``mlflow`` section of ``params.yaml``; a sqlite store that was moved or cloned is re-anchored where it is now (see
    :func:`detectors.registry.store.configure`). A team's ``mlflow server`` is named by its URL (``http(s)://host:port``):
    the model and its code are downloaded from the server's artifact store, through the server. Pass ``llm`` to reuse an
    LLM already in memory; it must be the detector's LLM, in the dtype the detector's features were computed in unless
    ``allow_dtype_mismatch``.
    """
    uri = tracking_uri or (None if params is not None else os.environ.get("MLFLOW_TRACKING_URI"))
    if uri:
        configure(uri)
    else:
        configure_params(params or "params.yaml")
    try:
        model = mlflow.pyfunc.load_model(f"models:/{name}@{alias}")
    except mlflow.exceptions.MlflowException as err:
        raise LookupError(
            f"no model registered as {name}@{alias} in {mlflow.get_tracking_uri()}: run `dvc repro` first, "
            f"or check the name and alias ({err})"
        ) from err
    detector = model.unwrap_python_model().detector
    if llm is not None:
        detector.attach(llm, allow_dtype_mismatch)
    return detector
