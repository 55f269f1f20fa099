"""Thin inference API: load a registered detector and ask it "retrieve now?".

    from detectors import load_detector
    # or $MLFLOW_TRACKING_URI
    det = load_detector("dior-early", alias="champion", tracking_uri="sqlite:///data/mlflow/mlflow.db")
    decision = det.assess("The capital of Occitania is")
    decision.retrieve, decision.probability, decision.keywords

Every registered kind loads the same way (see ``detectors.registry.kinds``) and is a
:class:`detectors.interfaces.Detector`, with its LLM loaded (or the one passed) and attached.
"""

from __future__ import annotations

import os

from detectors.interfaces import Detector
from detectors.llm.loading import LLM
from detectors.registry.store import NotRegisteredError, StoreNotNamedError, configure, load_version, resolve


def load_detector(
    name: str = "dior-early",
    alias: str = "champion",
    *,
    tracking_uri: str | None = None,
    llm: LLM | None = None,
    load_llm: bool = True,
    allow_dtype_mismatch: bool = False,
) -> Detector:
    """The detector registered as ``models:/<name>@<alias>``, ready to use.

    The store is ``tracking_uri`` (a relative sqlite path is relative to the working directory), else
    ``$MLFLOW_TRACKING_URI``; a team's ``mlflow server`` is named by its URL (``http(s)://host:port``) and must answer
    its health check, a sqlite store must exist and, if it was moved, be relocated first (see
    :func:`detectors.registry.store.configure`). ``llm``: an LLM already in memory (e.g. another detector's ``.llm``);
    it must be the detector's LLM, in the dtype its features were computed in unless ``allow_dtype_mismatch``. Otherwise
    the detector's own LLM is loaded now, from where its artifact says it came from (relative to the working directory:
    the project root), in the recorded dtype; ``load_llm=False`` skips that (inspecting a detector, or calling
    ``det.load_llm(root=..., device=...)`` yourself). The detector's files are checked against the sha256 recorded when
    it was written before anything is read from them (:func:`detectors.registry.store.load_version`)."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise StoreNotNamedError(
            f"load_detector({name!r}) needs the MLflow store: pass tracking_uri= (the project's is params.yaml's "
            "mlflow.tracking_uri, e.g. 'sqlite:///data/mlflow/mlflow.db' from the project root) or set "
            "$MLFLOW_TRACKING_URI"
        )
    configure(uri, existing=True)
    try:
        version = resolve(name, alias=alias)
    except NotRegisteredError as err:  # the name or alias is wrong: say which, and what the store holds
        raise NotRegisteredError(f"cannot load {name}@{alias}: {err}") from None
    detector = load_version(version, alias).unwrap_python_model().detector  # its files verified
    if llm is not None:
        detector.attach(llm, allow_dtype_mismatch)
    elif load_llm:
        detector.load_llm(allow_dtype_mismatch=allow_dtype_mismatch)
    return detector
