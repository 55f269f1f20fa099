"""FLARE's trigger: a token whose probability is below 1 - the threshold regenerates its sentence (the look-ahead
segment)
with the passages its masked query retrieves; the regenerated sentence is accepted, not judged again, and the passages
serve that sentence only (FLARE's §3, as DRAGIN's released TokenRAG also runs it)."""

from __future__ import annotations

import math

from detectors.baselines.flare import Flare
from detectors.interfaces import Level
from detectors.rag.triggers import PROBABILITY, Policy, Trigger, TriggerContext, TriggerEntry


def build(context: TriggerContext, settings: None) -> Trigger:
    # 1 - the token's probability
    return Trigger(
        "flare",
        Flare(Level.TOKEN),
        math.inf,
        Policy("token", cut="segment", after_retrieval="accept", passages="segment"),
        scores=PROBABILITY,
    )


FLARE = TriggerEntry(build, offline=Flare)
