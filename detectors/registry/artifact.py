"""The files of a trained detector: ``weights.safetensors`` (no pickle) and ``detector.json`` (its kind,
everything needed to rebuild and serve it, its scalers, the fingerprint of its LLM and the dtype its features were
computed in), and ``manifest.json``, the sha256 of each of its files, written last (:func:`seal`) and checked before
anything is read from it (:func:`verify`: a corrupted, truncated or missing file is an :class:`ArtifactIntegrityError`
naming it); and the input columns its ``predict_frame`` (the pyfunc) takes (:class:`FrameInputs`)."""

from __future__ import annotations

import functools
import json
import math
import numbers
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from detectors.ensemble import build_net
from detectors.errors import InputError
from detectors.io import changed_file, file_digests, write_json
from detectors.llm.fingerprint import Fingerprint

CONFIG = "detector.json"
WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.json"
REBUILD = "restore it (`dvc checkout`) or rebuild it (`dvc repro`)"


class ArtifactIntegrityError(InputError):
    """A file of a detector artifact is missing, unreadable or not the one that was written (its sha256 is not the one
    its manifest records), or the artifact records no digests: ``problem`` says which file and what, the message adds
    the ``fix``."""

    def __init__(self, problem: str, fix: str = REBUILD):
        self.problem = problem
        super().__init__(f"{problem}: {fix}")


class FrameInputError(InputError, ValueError):
    """A frame given to a detector's ``predict_frame`` (or its pyfunc) lacks a column, has an unknown one, or a bad
    value."""


class FrameInputs:
    """The columns a detector's ``predict_frame`` takes, declared once as its class attribute ``INPUTS`` (MLflow types:
    ``"string"``, a non-blank string; ``"double"``, a finite number). Declared in a class that defines
    ``predict_frame``,
    it checks every frame before the detector reads it: a missing or unknown column, or a missing or bad value, is a
    :class:`FrameInputError` naming it (instead of a bare ``KeyError``, or ``None`` scored as the text "None"). The
    registry logs the same columns as the pyfunc's input signature
    (:func:`detectors.registry.store.input_signature`)."""

    TYPES = ("string", "double")

    def __init__(self, required: dict[str, str], optional: dict[str, str] | None = None):
        self.required, self.optional = dict(required), dict(optional or {})
        for name, kind in {**self.required, **self.optional}.items():
            if kind not in self.TYPES:
                raise TypeError(f"input column {name!r}: type {kind!r} is not one of {self.TYPES}")

    def __set_name__(self, owner: type, name: str) -> None:
        predict = owner.__dict__.get("predict_frame")
        if predict is None:
            raise TypeError(
                f"{owner.__name__}.{name}: declare the input columns in the class that defines predict_frame"
            )

        @functools.wraps(predict)
        def checked(detector, frame, *args, **kwargs):
            return predict(detector, self.check(frame, f"detector {detector.KIND!r}"), *args, **kwargs)

        owner.predict_frame = checked

    def describe(self) -> str:
        columns = [f"{n} ({k})" for n, k in self.required.items()] + [
            f"{n} ({k}, optional)" for n, k in self.optional.items()
        ]
        return ", ".join(columns)

    def check(self, frame: Any, what: str) -> pd.DataFrame:
        """``frame`` when it has the declared columns and only those, with a usable value in every cell; else a
        :class:`FrameInputError` naming the column or the row and value."""
        takes = f"{what} takes a DataFrame with the columns {self.describe()}"
        if not isinstance(frame, pd.DataFrame):
            raise FrameInputError(f"{takes}, not a {type(frame).__name__}")
        missing = [c for c in self.required if c not in frame.columns]
        unknown = [c for c in frame.columns if c not in self.required and c not in self.optional]
        if missing or unknown:
            found = "; ".join(
                x for x in (missing and f"missing column(s) {missing}", unknown and f"unknown column(s) {unknown}") if x
            )
            raise FrameInputError(f"{takes}: {found} (columns given: {list(frame.columns)})")
        for name, kind in {**self.required, **self.optional}.items():
            if name not in frame.columns:
                continue
            for row, value in enumerate(frame[name].tolist()):
                problem = _problem(value, kind)
                if problem:
                    expected = "a non-blank string" if kind == "string" else "a finite number"
                    raise FrameInputError(f"{what}: row {row} of column {name!r} is {problem}: give {expected}")
        return frame


def _problem(value: Any, kind: str) -> str | None:
    """What is wrong with ``value`` as a cell of type ``kind`` (None: nothing)."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "missing (None/NaN)"
    if kind == "string":
        if not isinstance(value, str):
            return f"{value!r}, a {type(value).__name__}"
        return "blank" if not value.strip() else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{value!r}, a {type(value).__name__}"
    return None if math.isfinite(value) else f"{value!r}"


def seal(directory: str | Path) -> Path:
    """Record the sha256 of every file of the artifact in ``directory`` in its :data:`MANIFEST`; write it last, once
    the artifact is complete (every writer of an artifact calls it)."""
    directory = Path(directory)
    names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    write_json(directory / MANIFEST, {"files": file_digests(directory, [n for n in names if n != MANIFEST])})
    return directory


def verify(directory: str | Path) -> None:
    """Raise :class:`ArtifactIntegrityError` unless every file the artifact in ``directory`` recorded (:func:`seal`) is
    there with the sha256 it was written with."""
    manifest = Path(directory) / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        raise ArtifactIntegrityError(
            f"{directory} records no file digests (no {MANIFEST}: written before artifacts recorded them, or not "
            "completely), so its files cannot be verified"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ArtifactIntegrityError(f"{manifest} cannot be read ({type(err).__name__}: {err})") from None
    problem = changed_file(directory, files)
    if problem is not None:
        raise ArtifactIntegrityError(problem)


def write_artifact(directory: str | Path, kind: str, net: torch.nn.Module, config: dict[str, Any]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, directory / WEIGHTS)
    (directory / CONFIG).write_text(json.dumps({"kind": kind, **config}, indent=2))
    return seal(directory)


def read_config(directory: str | Path) -> dict[str, Any]:
    """The ``detector.json`` of the artifact in ``directory``, once its files are verified (:func:`verify`)."""
    path = Path(directory) / CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: not a detector artifact")
    verify(directory)
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
        raise ValueError(
            f"{what} has no feature_dtype column: it was built before feature dtypes were recorded; {rebuild}"
        )
    column = frame["feature_dtype"]
    found = sorted({None if pd.isna(v) else str(v) for v in column}, key=str)  # a record without one counts as None
    if len(found) != 1 or found[0] is None:
        counts = {(None if pd.isna(k) else str(k)): int(n) for k, n in column.value_counts(dropna=False).items()}
        raise ValueError(f"{what} has feature_dtype values {counts} (dtype: records), not exactly one; {rebuild}")
    if not isinstance(getattr(torch, found[0], None), torch.dtype):
        raise ValueError(
            f"{what} has feature_dtype = {found[0]!r}, not a torch dtype (e.g. 'float32', 'bfloat16'); {rebuild}"
        )
    return found[0]


def read_llm_section(section: dict[str, Any]) -> tuple[Fingerprint, dict[str, Any]]:
    ref = dict(section)
    return Fingerprint.from_dict(ref.pop("fingerprint")), ref


def read_net(directory: str | Path, kind: str, net_class: type[torch.nn.Module]):
    """A trained detector's config, its network (weights loaded, eval mode; a seed ensemble of ``net_class`` nets when
    the config says so, :func:`~detectors.ensemble.build_net`), LLM fingerprint and LLM reference."""
    config, weights = read_artifact(directory, kind)
    net = build_net(net_class, config["net"])
    net.load_state_dict(weights)
    net.eval()
    return (config, net, *read_llm_section(config["llm"]))
