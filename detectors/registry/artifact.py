"""The files of a trained detector: ``weights.safetensors`` (no pickle) and ``detector.json`` (its kind,
everything needed to rebuild and serve it, its scalers, the fingerprint of its LLM and the dtype its features were
computed in), and ``manifest.json``, the sha256 of each of its files, written last (:func:`seal`) and checked before
anything is read from it (:func:`verify`: a corrupted, truncated or missing file is an :class:`ArtifactIntegrityError`
naming it); and the input columns its ``predict_frame`` (the pyfunc) takes (:class:`FrameInputs`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import typing
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from detectors.config.core import from_dict
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


class DeclaredArtifact:
    """A trained detector (a dataclass) saved and loaded from its declared fields, so that a new kind writes no
    ``save``/``load`` of its own. The field named by ``NET`` is its network: weights in :data:`WEIGHTS`, its config
    under ``"net"`` (a seed ensemble rebuilt by :func:`~detectors.ensemble.build_net` from the field's type);
    ``fingerprint`` and ``llm_ref`` are the ``"llm"`` section; every other field is stored under its name by its type:
    an array as a list (read back as float32), a type with ``to_dict``/``from_dict`` by them, a params dataclass as a
    mapping (read back with its checks), numbers and JSON values as they are. ``llm`` and fields starting with ``_``
    are the runtime's, never stored. A field an older artifact lacks takes its default; ``RENAMED`` maps a field to
    the key older artifacts stored it under."""

    KIND: ClassVar[str]
    NET: ClassVar[str] = "net"
    RENAMED: ClassVar[dict[str, str]] = {}

    @classmethod
    def _stored(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.name != "llm" and not f.name.startswith("_")]  # type: ignore[arg-type]

    def save(self, directory: str | Path) -> Path:
        config: dict[str, Any] = {}
        for f in self._stored():
            value = getattr(self, f.name)
            if f.name == self.NET:
                config["net"] = value.config
            elif f.name == "fingerprint":
                config["llm"] = llm_section(value, self.llm_ref)
            elif f.name != "llm_ref":
                config[f.name] = _stored_value(value)
        return write_artifact(directory, self.KIND, getattr(self, self.NET), config)

    @classmethod
    def load(cls, directory: str | Path):
        config, weights = read_artifact(directory, cls.KIND)
        hints = typing.get_type_hints(cls)
        fields: dict[str, Any] = {}
        for f in cls._stored():
            if f.name == cls.NET:
                net = build_net(hints[f.name], config["net"])
                net.load_state_dict(weights)
                fields[f.name] = net.eval()
            elif f.name == "fingerprint":
                fields["fingerprint"], fields["llm_ref"] = read_llm_section(config["llm"])
            elif f.name != "llm_ref":
                key = f.name if f.name in config else cls.RENAMED.get(f.name, f.name)
                if key in config:
                    fields[f.name] = _read_value(hints[f.name], config[key], f"detector.{f.name}")
                elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ArtifactIntegrityError(f"{Path(directory) / CONFIG} has no {f.name!r}")
        return cls(**fields)


def _stored_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def _read_value(tp: Any, value: Any, key: str) -> Any:
    if tp is np.ndarray:
        return np.asarray(value, dtype=np.float32)
    if hasattr(tp, "from_dict"):
        return tp.from_dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if tp in (int, float):
        return tp(value)
    return value
