"""The extension points are lazy registries (detectors.lazy), each name declared once: every entry loads, an unknown
name is one error listing the known ones, and what reads the names (the params' validation, the command line) reads
the registries."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

import pytest

from detectors.config.sections import SECTIONS
from detectors.errors import InputError
from detectors.extensions import DETECTOR_KINDS, DETECTOR_TRIGGERS, FRAMEWORKS, QUERIES, TRAINING_FREE
from detectors.imports import declared_classes, import_closure
from detectors.lazy import LazyRegistry
from detectors.rag.queries import QueryEntry
from detectors.rag.triggers import TriggerEntry
from detectors.registry.kinds import KINDS, kinds_deciding

REGISTRIES = [TRAINING_FREE, DETECTOR_TRIGGERS, QUERIES, FRAMEWORKS, KINDS, SECTIONS]


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.what)
def test_every_entry_of_every_registry_loads(registry):
    for name in registry:
        entry = registry.load(name)
        assert callable(entry.build if isinstance(entry, (TriggerEntry, QueryEntry)) else entry), (registry.what, name)


def test_builders_of_one_registry_share_one_signature():
    """A dispatcher calls every entry the same way: every trigger entry (training-free or a detector kind) builds from
    (context, its own settings), every query entry from (its own settings, the configuration's triggers, idf), each
    declaring its settings' type as a dataclass or none."""
    for registry in (TRAINING_FREE, DETECTOR_TRIGGERS):
        for name in registry:
            entry = registry.load(name)
            assert isinstance(entry, TriggerEntry), (registry.what, name)
            assert len(inspect.signature(entry.build).parameters) == 2, (registry.what, name)
            assert entry.settings is None or dataclasses.is_dataclass(entry.settings), (registry.what, name)
    for name in QUERIES:
        entry = QUERIES.load(name)
        assert isinstance(entry, QueryEntry), name
        assert len(inspect.signature(entry.build).parameters) == 3, name
        assert entry.settings is None or dataclasses.is_dataclass(entry.settings), name


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.what)
def test_an_unknown_name_is_one_error_naming_every_known_one(registry):
    """A name no entry has is one error of the registry's own type that names it and lists every registered name,
    sorted: whatever entries a registry holds, a reader sees all of them."""
    known = re.escape(", ".join(sorted(registry)))
    with pytest.raises(registry.error, match=rf"^no {re.escape(registry.what)} named 'no-such-entry'; known: {known}$"):
        registry.load("no-such-entry")


def test_an_unknown_framework_is_an_input_error():
    with pytest.raises(InputError, match=r"^no framework named 'selfrag'; known: .*\bretrorag\b"):
        FRAMEWORKS.load("selfrag")
    assert FRAMEWORKS.load("retrorag").__name__ == "RetroRag"


def test_the_command_lines_detector_kinds_come_from_the_detector_classes():
    """``dynrag assess`` takes the kinds that decide from the question, ``monitor`` those that watch a generation
    (``Detector.DECIDES``, declared by each class): every registered kind decides one of the two or none, and every kind
    a trigger can be built from decides one of the two and names a registered trigger (``TRIGGER``)."""
    question, generation = kinds_deciding("question"), kinds_deciding("generation")
    for kind in KINDS:
        decides = KINDS.load(kind).DECIDES
        assert decides in ("question", "generation", None), (kind, decides)
        assert (kind in question, kind in generation) == (decides == "question", decides == "generation"), kind
    assert set(DETECTOR_KINDS) == set(question) | set(generation)
    for kind in KINDS:
        trigger = KINDS.load(kind).TRIGGER
        assert (trigger is None) == (kind not in DETECTOR_KINDS), kind
        assert trigger is None or trigger in DETECTOR_TRIGGERS, (kind, trigger)
    assert {"dior-early", "utility"} <= set(question) and {"dior-realtime", "ctrla-confidence"} <= set(generation)
    assert KINDS.load("ctrla-honesty").DECIDES is None


# ---- a declared registry: a new kind's class registers itself where it is written --------------------------------


def _package(root, files: dict[str, str]) -> None:
    for name, text in {"detectors/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_kind_declared_in_its_own_module_is_registered_and_in_the_closure_of_what_loads_kinds(tmp_path):
    """A class that declares ``KIND`` (and a ``TRIGGER``) in a module nothing lists is a registered kind (and a trigger
    kind): the registry reads the sources, and a module holding the registry loads it (its import closure, hence the
    code deps of every stage that loads detectors); the params' names read no module."""
    _package(
        tmp_path,
        {
            "detectors/probe/__init__.py": "",
            "detectors/probe/detector.py": """
                import numpy

                class Probe:
                    KIND = "probe"
                    DECIDES = "question"
                    TRIGGER = "early"

                class NotAKind:
                    kind = "lower case is not the attribute"
                """,
            "detectors/steer.py": """
                class Steer:
                    KIND = "steer"
                """,
            "detectors/kinds.py": """
                from detectors.lazy import LazyRegistry

                KINDS = LazyRegistry.declared("detector kind", "KIND")
                """,
        },
    )
    assert declared_classes("KIND", root=tmp_path) == {
        "probe": "detectors.probe.detector:Probe",
        "steer": "detectors.steer:Steer",
    }
    assert declared_classes("KIND", having="TRIGGER", root=tmp_path) == {"probe": "detectors.probe.detector:Probe"}
    files, external = import_closure(["detectors.kinds"], root=tmp_path)
    assert {"detectors/probe/detector.py", "detectors/steer.py"} <= {p.as_posix() for p in files}
    assert "numpy" in external
    files, _ = import_closure(["detectors.kinds"], root=tmp_path, lazy=["detectors.kinds"])  # dispatching by name
    assert "detectors/probe/detector.py" not in {p.as_posix() for p in files}


def test_a_kind_declared_twice_or_a_registry_the_closure_cannot_read_is_an_error(tmp_path):
    _package(
        tmp_path,
        {
            "detectors/a.py": "class A:\n    KIND = 'same'\n",
            "detectors/b.py": "class B:\n    KIND = 'same'\n",
            "detectors/kinds.py": "from detectors.lazy import LazyRegistry\nATTR = 'KIND'\n"
            "KINDS = LazyRegistry.declared('kind', ATTR)\n",
        },
    )
    with pytest.raises(ValueError, match=r"KIND = 'same' is declared twice \(detectors\.a:A and detectors\.b:B\)"):
        declared_classes("KIND", root=tmp_path)
    with pytest.raises(ValueError, match=r"kinds\.py:3: write LazyRegistry\.declared's attribute as a string literal"):
        import_closure(["detectors.kinds"], root=tmp_path)


def test_the_project_kinds_are_exactly_its_declared_classes():
    """KINDS holds every class of the package that declares a KIND, each loading to a class with that KIND."""
    assert dict(KINDS) == declared_classes("KIND")
    assert isinstance(KINDS, LazyRegistry) and all(KINDS.load(kind).KIND == kind for kind in KINDS)
