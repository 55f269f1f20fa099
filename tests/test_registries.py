"""The extension points are lazy registries (detectors.lazy), each name declared once: every entry loads, an unknown
name is one error listing the known ones, and what reads the names (the params' validation, the command line) reads
the registries."""

from __future__ import annotations

import inspect

import pytest

from detectors.config.sections import SECTIONS
from detectors.errors import InputError
from detectors.extensions import DETECTOR_KINDS, FRAMEWORKS, QUERIES, TRAINING_FREE
from detectors.registry.kinds import KINDS, kinds_deciding

REGISTRIES = [TRAINING_FREE, DETECTOR_KINDS, QUERIES, FRAMEWORKS, KINDS, SECTIONS]


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.what)
def test_every_entry_of_every_registry_loads(registry):
    for name in registry:
        assert callable(registry.load(name)), (registry.what, name)


def test_builders_of_one_registry_share_one_signature():
    """A dispatcher calls every entry the same way: the trigger builders (llm, threshold, spacy model, settings), the
    detector-kind builders (name, detector, settings), the query builders (section, FLARE's threshold, idf)."""
    for registry, arity in ((TRAINING_FREE, 4), (DETECTOR_KINDS, 3), (QUERIES, 3)):
        for name in registry:
            assert len(inspect.signature(registry.load(name)).parameters) == arity, (registry.what, name)


def test_an_unknown_framework_is_one_error_naming_the_known_ones():
    with pytest.raises(InputError, match=r"^no framework named 'selfrag'; known: retrorag$"):
        FRAMEWORKS.load("selfrag")
    assert FRAMEWORKS.load("retrorag").__name__ == "RetroRag"


def test_the_command_lines_detector_kinds_come_from_the_detector_classes():
    """``dynrag assess`` takes the kinds that decide from the question, ``monitor`` those that watch a generation
    (``Detector.DECIDES``, declared by each class); every kind a trigger can be built from decides one of the two."""
    assert kinds_deciding("question") == ["dior-early", "utility"]
    assert kinds_deciding("generation") == ["dior-realtime", "ctrla-confidence"]
    assert set(DETECTOR_KINDS) == set(kinds_deciding("question")) | set(kinds_deciding("generation"))
    assert KINDS.load("ctrla-honesty").DECIDES is None
