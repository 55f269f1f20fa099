"""The extension points are lazy registries (detectors.lazy), each name declared once: every entry loads, an unknown
name is one error listing the known ones, and what reads the names (the params' validation, the command line) reads
the registries."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from detectors.config.sections import SECTIONS
from detectors.errors import InputError
from detectors.extensions import DETECTOR_KINDS, FRAMEWORKS, QUERIES, TRAINING_FREE
from detectors.rag.queries import QueryEntry
from detectors.rag.triggers import TriggerEntry
from detectors.registry.kinds import KINDS, kinds_deciding

REGISTRIES = [TRAINING_FREE, DETECTOR_KINDS, QUERIES, FRAMEWORKS, KINDS, SECTIONS]


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.what)
def test_every_entry_of_every_registry_loads(registry):
    for name in registry:
        entry = registry.load(name)
        assert callable(entry.build if isinstance(entry, (TriggerEntry, QueryEntry)) else entry), (registry.what, name)


def test_builders_of_one_registry_share_one_signature():
    """A dispatcher calls every entry the same way: every trigger entry (training-free or a detector kind) builds from
    (context, its own settings), every query entry from (its own settings, the configuration's triggers, idf), each
    declaring its settings' type as a dataclass or none."""
    for registry in (TRAINING_FREE, DETECTOR_KINDS):
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
    a trigger can be built from decides one of the two."""
    question, generation = kinds_deciding("question"), kinds_deciding("generation")
    for kind in KINDS:
        decides = KINDS.load(kind).DECIDES
        assert decides in ("question", "generation", None), (kind, decides)
        assert (kind in question, kind in generation) == (decides == "question", decides == "generation"), kind
    assert set(DETECTOR_KINDS) == set(question) | set(generation)
    assert {"dior-early", "utility"} <= set(question) and {"dior-realtime", "ctrla-confidence"} <= set(generation)
    assert KINDS.load("ctrla-honesty").DECIDES is None
