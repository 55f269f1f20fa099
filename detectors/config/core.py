"""Reading ``params.yaml``: typed dataclasses built from mappings, with errors that name the key and the value.

Stage sections are read *strictly*: every key of the section, nested ones included, must be in
``params.yaml`` (it is the single source of truth; the section types have no defaults). Artifact schema
types (:mod:`detectors.config.schema`) keep their defaults so that an artifact written before a key
existed still loads.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from detectors.errors import InputError

T = TypeVar("T")


class ParamsError(InputError, ValueError):
    """A value in params.yaml is missing, unknown or invalid."""


def fail(key: str, value: Any, why: str) -> typing.NoReturn:
    raise ParamsError(f"params: {key} = {value!r}: {why}")


def _convert(tp: Any, value: Any, key: str, strict: bool = False) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key, strict)
            except ParamsError:
                pass
        fail(key, value, f"expected {tp}")
    if origin is Literal:
        if value not in args:
            fail(key, value, f"must be one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            fail(key, value, "expected a list")
        return [_convert(args[0], v, f"{key}[{i}]", strict) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            fail(key, value, "expected a mapping")
        return {str(k): _convert(args[1], v, f"{key}.{k}", strict) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key, strict)
    if tp is bool:
        if not isinstance(value, bool):
            fail(key, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, value, "expected a string")
        return value
    raise TypeError(f"unsupported params type {tp!r} for {key}")


def from_dict(cls: type[T], data: Any, where: str, strict: bool = False) -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types; then run its ``check``.

    ``strict``: every field must be given, at every depth (defaults are not used).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        fail(where, data, "expected a mapping of keys")
    with_defaults = getattr(cls, "with_defaults", None)  # a section whose rows share defaults fills them in first
    if with_defaults is not None:
        data = with_defaults(data, where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        fail(f"{where}.{unknown[0]}", data[unknown[0]], f"unknown key; known keys: {sorted(fields)}")
    kwargs = {}
    for name, field in fields.items():
        key = f"{where}.{name}"
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key, strict)
        elif strict or (field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING):
            fail(key, None, "required key is missing: add it to params.yaml")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(where)
    return obj


def entry_settings(declared: type | None, name: str, given: Any, key: str, what: str) -> Any:
    """The settings of registry entry ``name`` from ``given`` (the section ``key``: a mapping of entry name to its
    params, as a mapping or already of the entry's type), of the type the entry ``declared`` (None: it takes none);
    None when none are given. Settings for an entry that takes none are refused (``what``: what the entry is)."""
    value = (given or {}).get(name)
    if value is None:
        return None
    if declared is None:
        raise ParamsError(
            f"params: {key}.{name}: {what} {name!r} takes no settings; remove the key (entries with settings: those "
            "whose entry declares a settings type)"
        )
    if isinstance(value, declared):
        return value
    return from_dict(declared, value, f"{key}.{name}", strict=True)


def positive(key: str, value: float | int) -> None:
    if not value > 0:  # also refuses NaN
        fail(key, value, "must be positive")


def check_share(key: str, value: float) -> None:
    if not 0 <= value < 1:  # also refuses NaN
        fail(key, value, "a share of records must be in [0, 1)")


def check_splits(key: str, splits: dict[str, float]) -> None:
    """Train/val/test ratios: exactly those keys, each in (0, 1), summing to 1."""
    if set(splits) != {"train", "val", "test"}:
        fail(key, splits, "must have exactly the keys train, val and test")
    for name, ratio in splits.items():
        if not 0 < ratio < 1:
            fail(f"{key}.{name}", ratio, "each ratio must be between 0 and 1")
    total = sum(splits.values())
    if abs(total - 1.0) > 1e-6:
        fail(key, splits, f"ratios sum to {total:g}, they must sum to 1")


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans, ``true`` and ``false`` only: ``yes``, ``no``, ``on`` and ``off``
    stay strings, as DVC (a YAML 1.2 reader and writer) reads them, and as it writes them back, unquoted, when
    ``dvc exp run -S`` rewrites the params file."""


Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """A params document as the stages and DVC read it (:class:`Yaml12Loader`)."""
    return yaml.load(text, Loader=Yaml12Loader)


def read_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"params file {path} not found: run from the project root or pass --params")
    data = load_yaml(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ParamsError(f"params file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def check_fields(key: str, template: str, fields: tuple[str, ...], required: tuple[str, ...] | None = None) -> None:
    """``template`` holds each of ``required`` (default: every field) exactly once and no field but ``fields``."""
    for field in fields if required is None else required:
        if template.count("{" + field + "}") != 1:
            fail(key, template, f"must contain {{{field}}} exactly once")
    try:
        template.format(**{f: "" for f in fields})
    except (KeyError, IndexError, ValueError) as err:
        fail(
            key,
            template,
            f"only {', '.join('{' + f + '}' for f in fields)} may be in braces (double other braces): {err!r}",
        )
