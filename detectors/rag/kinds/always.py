"""Single-round RAG's trigger: ``always`` retrieves once for every question, before generating."""

from __future__ import annotations

from detectors.rag.triggers import Constant, Policy, Trigger


def build(llm: object, threshold: float | None, spacy_model: str, settings: object) -> Trigger:
    return Trigger("always", Constant(), 0.0, Policy("question"))
