"""Presets: a named setting written as an overlay of ``params.yaml`` (``presets/<name>.yaml`` holds only the keys
that differ, each with its reason), applied by writing a params file that the stages then read.

A preset's mappings merge key by key into ``params.yaml``'s; any other value (a string, a number, a list), and a
mapping tagged ``!replace`` (a table whose keys the preset replaces: ``register.detectors`` over other corpora),
replaces the value at its key; a key that ``params.yaml`` lacks is added (a new corpus under
``index_corpus.corpora``). The result is written by a round-trip YAML writer that keeps ``params.yaml``'s comments
and quoting, and validated by every section's type (:func:`detectors.config.load_all`, what the stages run) before
it is written anywhere::

    python -m detectors.config.presets presets/paper.yaml                       # check it, list what it changes
    python -m detectors.config.presets presets/paper.yaml --write params.yaml   # apply it, then `dvc exp run`

(``dvc exp run -S key=value`` sets single keys too; a preset keeps many, with their reasons, in a file.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from detectors.config import load_all
from detectors.config.core import ParamsError, Yaml12Loader, load_yaml, read_params
from detectors.errors import one_line, traceback_wanted

NEW = object()  # the old value of a key params.yaml lacks


class Whole(dict):
    """A preset mapping tagged ``!replace``: it replaces the mapping at its key instead of merging into it."""


class _PresetLoader(Yaml12Loader):
    """The params reader, and ``!replace`` on a mapping (:class:`Whole`)."""


_PresetLoader.add_constructor("!replace", lambda loader, node: Whole(loader.construct_mapping(node, deep=True)))


def read_preset(path: str | Path) -> dict[str, Any]:
    """The preset's overlay (a mapping of params sections), read as the stages read ``params.yaml``."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"preset {str(path)!r} not found: give a preset file, e.g. presets/paper.yaml")
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=_PresetLoader)
    if not isinstance(data, dict) or not data:
        raise ParamsError(
            f"preset {path} must hold a mapping of params sections (the keys that differ from params.yaml), "
            f"got {data!r}"
        )
    return data


def leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every value the overlay sets: mappings are walked, anything else (an empty mapping
    and a :class:`Whole` included) is set as a whole."""
    out = []
    for key, value in tree.items():
        if not isinstance(key, str) or not key or "." in key:
            raise ParamsError(
                f"preset key {prefix}{key!r}: keys are non-empty strings without dots (nest mappings instead)"
            )
        if isinstance(value, dict) and value and not isinstance(value, Whole):
            out.extend(leaves(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def changes(preset: dict[str, Any], params: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, value in params, value in the preset)`` of every value the preset sets (:data:`NEW` when params
    lacks the key)."""
    out = []
    for dotted, value in leaves(preset):
        node: Any = params
        for part in dotted.split("."):
            node = node.get(part, NEW) if isinstance(node, dict) else NEW
        out.append((dotted, node, value))
    return out


def _yaml():
    """A round-trip writer (ruamel.yaml, which the pinned dvc brings) that leaves params.yaml's text as it was where
    no value changes (comments, quoting, flow lists, ``null``), and writes no line break inside a long template."""
    from ruamel.yaml import YAML
    from ruamel.yaml.representer import RoundTripRepresenter

    class Representer(RoundTripRepresenter):  # a subclass: ruamel's representers are class-wide
        pass

    Representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    writer = YAML(typ="rt")
    writer.Representer = Representer
    writer.preserve_quotes = True
    writer.width = 1 << 16
    writer.indent(mapping=2, sequence=4, offset=2)
    return writer


def _plain_reads_back(value: str) -> bool:
    """Whether ``value`` written without quotes reads back as itself (:func:`~detectors.config.core.load_yaml`), as a
    mapping's value and in a flow list (``true``, ``null``, ``1.0`` or a template with a line break do not)."""
    try:
        return load_yaml(f"k: {value}") == {"k": value} and load_yaml(f"[{value}]") == [value]
    except yaml.YAMLError:
        return False


def _node(value: Any) -> Any:
    """A preset value as the writer should spell it: a string plain where it reads back as itself
    (:func:`_plain_reads_back`), else double-quoted; lists and mappings in flow style, as params.yaml writes them."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    if isinstance(value, str):
        return value if _plain_reads_back(value) else DoubleQuotedScalarString(value)
    if isinstance(value, list):
        seq = CommentedSeq(_node(v) for v in value)
        seq.fa.set_flow_style()
        return seq
    if isinstance(value, dict):
        mapping = CommentedMap((k, _node(v)) for k, v in value.items())
        if not isinstance(value, Whole):  # a replaced table keeps a line an entry
            mapping.fa.set_flow_style()
        return mapping
    return value


def write_applied(preset: dict[str, Any], params_path: str | Path, out: str | Path) -> None:
    """Write ``params_path`` with ``preset`` applied to ``out`` (unvalidated: :func:`apply` validates)."""
    from ruamel.yaml.comments import CommentedMap

    writer = _yaml()
    with open(params_path, encoding="utf-8") as f:
        data = writer.load(f)
    for dotted, value in leaves(preset):
        *parents, last = dotted.split(".")
        node = data
        for i, part in enumerate(parents):
            if part not in node:
                node[part] = CommentedMap()
            node = node[part]
            if not isinstance(node, dict):
                where = ".".join(parents[: i + 1])
                raise ParamsError(
                    f"preset key {dotted}: {where} is not a mapping in {params_path} ({node!r}): set {where} itself"
                )
        node[last] = _node(value)
    with open(out, "w", encoding="utf-8") as f:
        writer.dump(data, f)


def apply(
    preset_path: str | Path, params_path: str | Path = "params.yaml", out: str | Path | None = None
) -> list[tuple[str, Any, Any]]:
    """Apply the preset to ``params_path``, validate the result as the stages do, and write it to ``out`` (None: write
    nothing). Returns :func:`changes`. A key or value the sections refuse is a :class:`ParamsError` naming the
    preset."""
    preset = read_preset(preset_path)
    found = changes(preset, read_params(params_path))
    with tempfile.TemporaryDirectory() as tmp:
        applied = Path(tmp) / "params.yaml"
        write_applied(preset, params_path, applied)
        try:
            load_all(applied)
        except ParamsError as err:
            raise ParamsError(f"preset {preset_path} applied to {params_path}: {err}") from None
        if out is not None:
            shutil.copyfile(applied, out)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", help="the preset file, e.g. presets/paper.yaml")
    parser.add_argument("--params", default="params.yaml", help="the params file it applies to (default: params.yaml)")
    parser.add_argument(
        "--write", metavar="PATH", help="write the params with the preset applied to PATH (may be --params)"
    )
    args = parser.parse_args(argv)
    try:
        found = apply(args.preset, args.params, args.write)
    except ParamsError as err:
        if traceback_wanted():
            raise
        print(one_line(err), file=sys.stderr)
        raise SystemExit(1) from None
    print(f"{args.preset} applied to {args.params} validates; it sets {len(found)} values:")
    for dotted, old, new in found:
        print(f"  {dotted}: {'(new)' if old is NEW else repr(old)} -> {new!r}")
    if args.write:
        print(f"written to {args.write}")
    else:
        print(f"nothing written: --write {args.params} applies it (then `dvc exp run`, or `dvc repro`)")


if __name__ == "__main__":
    main()
