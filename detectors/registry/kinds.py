"""The registered detector kinds: the ``kind`` written in an artifact's ``detector.json`` names the class that loads
it (:data:`KINDS`, a declared lazy registry: every detector class that declares a ``KIND``, found in the sources; each
class is imported only when its kind is loaded, and a new kind's class registers itself)."""

from __future__ import annotations

from pathlib import Path

from detectors.interfaces import Detector
from detectors.lazy import LazyRegistry
from detectors.registry.artifact import read_config

KINDS = LazyRegistry.declared("detector kind", "KIND", error=ValueError)


def detector_class(kind: str) -> type[Detector]:
    """The class of detector kind ``kind`` (a ValueError listing the known kinds if none)."""
    return KINDS.load(kind)


def kinds_deciding(when: str) -> list[str]:
    """The kinds whose detectors decide retrieval ``when`` (``Detector.DECIDES``: "question" or "generation")."""
    return [kind for kind in KINDS if KINDS.load(kind).DECIDES == when]


def load_artifact(directory: str | Path) -> Detector:
    """The detector stored in ``directory``, whatever its kind."""
    kind = read_config(directory).get("kind")
    if kind not in KINDS:
        raise ValueError(f"{directory} holds a detector of kind {kind!r}; known kinds: {list(KINDS)}")
    return KINDS.load(kind).load(directory)
