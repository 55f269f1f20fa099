"""``params.yaml``: validated stage sections (:mod:`.sections`), the artifact schema types that library
functions take (:mod:`.schema`), and the reading machinery (:mod:`.core`).

A stage reads its params through :class:`StageParams`, which hands out only the keys the stage
declared (the same keys ``dvc.yaml`` lists as its params), so a stage cannot read a value that DVC
does not track for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from detectors.config.core import ParamsError, fail, from_dict, load_yaml, read_params
from detectors.config.sections import SECTIONS, section_type


def expanded_reads(reads: Iterable[str], data: dict[str, Any]) -> tuple[str, ...]:
    """A stage's declared params keys (``READS``), each ``"${section.key}"`` entry replaced by the sections that the
    list at that key of ``data`` names: ``rag_eval`` declares ``"${rag_eval.frameworks}"`` and reads the section of
    every framework it runs, so no stage lists a framework's name. A key that holds something else than a list of
    names is a ParamsError; a missing one names none (the section's own validation refuses it)."""
    out: list[str] = []
    for key in reads:
        if not (key.startswith("${") and key.endswith("}")):
            out.append(key)
            continue
        value: Any = data
        for part in key[2:-1].split("."):
            value = value.get(part) if isinstance(value, dict) else None
        value = [] if value is None else value  # missing: none (its section's validation says so)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            fail(key[2:-1], value, "a list of params section names, e.g. [retrorag] ([] for none)")
        out += [name for name in value if name not in out]
    return tuple(out)


def load_section(name: str, path: str | Path = "params.yaml", data: dict[str, Any] | None = None) -> Any:
    """Validate and return section ``name`` of the params file as its dataclass (every key required)."""
    kind = section_type(name)
    data = read_params(path) if data is None else data
    if name not in data:
        fail(name, None, "required section is missing: add it to params.yaml")
    if hasattr(kind, "from_params"):  # an open section (paths), validated by its own rule
        return kind.from_params(data.get(name), name)
    return from_dict(kind, data.get(name), name, strict=True)


def load_all(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Validate every section (unknown top-level sections are an error too)."""
    data = read_params(path)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        fail(unknown[0], data[unknown[0]], f"unknown params section; known: {sorted(SECTIONS)}")
    return {name: load_section(name, data=data) for name in SECTIONS}


class StageParams:
    """The params of one stage: only the declared keys (``section`` or ``section.key.subkey``) can be read.

    ``params["paths.qa"]`` returns that value; ``params["build_early"]`` the whole validated section.
    Reading an undeclared key is an error: declare it in the stage's ``READS`` and in ``dvc.yaml``. A declared
    ``"${section.key}"`` is every section the list at that key names (:func:`expanded_reads`).
    """

    def __init__(self, data: dict[str, Any], reads: Iterable[str], stage: str = "this stage"):
        self.data, self.reads, self.stage = data, expanded_reads(reads, data), stage
        self.items: list[str] = []  # a stage run once per key of a params table: the keys this run is for
        self._sections: dict[str, Any] = {}
        for key in self.reads:  # validate every declared section, and that each key exists, before any heavy work
            self._resolve(key)

    @classmethod
    def of(cls, stage: str, path: str | Path = "params.yaml") -> StageParams:
        """Stage ``stage``'s params from the params file ``path``, the keys it declares as ``dvc.yaml`` (beside
        ``path``) lists them: what a benchmark or notebook that runs a stage's computation reads."""
        dvc = Path(path).with_name("dvc.yaml")
        try:
            entry = load_yaml(dvc.read_text(encoding="utf-8"))["stages"][stage]
            reads = entry.get("do", entry)["params"]  # a foreach stage's are those of its ``do``
        except (OSError, KeyError, TypeError) as err:
            raise ParamsError(
                f"{dvc} lists no params of stage {stage!r} ({type(err).__name__}: {err}): pass the params file "
                "of a checkout of the project, beside its dvc.yaml"
            ) from err
        return cls(read_params(path), reads, stage)

    def _section(self, name: str) -> Any:
        if name not in self._sections:
            self._sections[name] = load_section(name, data=self.data)
        return self._sections[name]

    def __getitem__(self, key: str) -> Any:
        if not any(key == r or key.startswith(r + ".") for r in self.reads):
            raise ParamsError(
                f"{self.stage} reads params key {key!r} but does not declare it: add it to the stage's READS "
                "and to its params in dvc.yaml, so DVC reruns the stage when it changes"
            )
        return self._resolve(key)

    def _resolve(self, key: str) -> Any:
        section, *rest = key.split(".")
        value = self._section(section)
        for i, part in enumerate(rest):
            if not hasattr(value, part):
                fail(
                    ".".join([section, *rest[: i + 1]]),
                    None,
                    f"{self.stage} declares this params key but params.yaml has no such key",
                )
            value = getattr(value, part)
        return value
