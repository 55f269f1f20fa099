"""The files of a trained detector: ``weights.safetensors`` (no pickle) and ``detector.json`` (its kind,
everything needed to rebuild and serve it, the fingerprint of its LLM and the dtype its features were
computed in)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from detectors.llm.fingerprint import Fingerprint

CONFIG = "detector.json"
WEIGHTS = "weights.safetensors"


def write_artifact(directory: str | Path, kind: str, net: torch.nn.Module, config: dict[str, Any]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, directory / WEIGHTS)
    (directory / CONFIG).write_text(json.dumps({"kind": kind, **config}, indent=2))
    return directory


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: not a detector artifact")
    return json.loads(path.read_text())


def read_artifact(directory: str | Path, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and weights of a ``kind`` artifact; another kind is a clear error."""
    config = read_config(directory)
    if config.get("kind") != kind:
        raise ValueError(f"{directory} holds a {config.get('kind')!r} artifact, not {kind!r}")
    return config, load_file(Path(directory) / WEIGHTS)


def llm_section(fingerprint: Fingerprint, llm_ref: dict[str, Any]) -> dict[str, Any]:
    """The ``llm`` entry of ``detector.json``: the fingerprint, where the LLM came from and its feature dtype."""
    return {"fingerprint": fingerprint.to_dict(), **llm_ref}


def frame_dtype(frame: pd.DataFrame, what: str) -> str:
    """The one dtype the features of ``frame`` were computed in (its ``feature_dtype`` column); a set built
    without it, or partly in another dtype (e.g. a set concatenated from two builds), is a clear error. (The
    build stages key their shards on the LLM's dtype, so they never mix dtypes.)"""
    rebuild = f"rebuild {what} with `dvc repro` so that all records share one LLM dtype"
    if "feature_dtype" not in frame.columns:
        raise ValueError(f"{what} has no feature_dtype column: it was built before feature dtypes were recorded; {rebuild}")
    column = frame["feature_dtype"]
    found = sorted({None if pd.isna(v) else str(v) for v in column}, key=str)  # a record without one counts as None
    if len(found) != 1 or found[0] is None:
        counts = {(None if pd.isna(k) else str(k)): int(n) for k, n in column.value_counts(dropna=False).items()}
        raise ValueError(f"{what} has feature_dtype values {counts} (dtype: records), not exactly one; {rebuild}")
    if not isinstance(getattr(torch, found[0], None), torch.dtype):
        raise ValueError(f"{what} has feature_dtype = {found[0]!r}, not a torch dtype (e.g. 'float32', 'bfloat16'); {rebuild}")
    return found[0]


def read_llm_section(section: dict[str, Any]) -> tuple[Fingerprint, dict[str, Any]]:
    ref = dict(section)
    return Fingerprint.from_dict(ref.pop("fingerprint")), ref


def read_net(directory: str | Path, kind: str, net_class: type[torch.nn.Module]):
    """A trained detector's config, its network (weights loaded, eval mode), LLM fingerprint and LLM reference."""
    config, weights = read_artifact(directory, kind)
    net = net_class(**config["net"])
    net.load_state_dict(weights)
    net.eval()
    return (config, net, *read_llm_section(config["llm"]))
