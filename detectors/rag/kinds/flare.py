"""FLARE's trigger: a token whose probability is below 1 - the threshold regenerates its sentence (the look-ahead segment)."""

from __future__ import annotations

from detectors.baselines.flare import Flare
from detectors.interfaces import Level
from detectors.rag.triggers import PROBABILITY, Policy, Trigger


def build(llm: object, threshold: float | None, spacy_model: str, settings: object) -> Trigger:
    return Trigger("flare", Flare(Level.TOKEN), threshold, Policy("token", cut="segment"), scores=PROBABILITY)  # 1 - the token's probability
