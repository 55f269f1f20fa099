"""Single-round RAG's trigger: ``always`` retrieves once for every question, before generating."""

from __future__ import annotations

from detectors.rag.triggers import Constant, Policy, Trigger, TriggerContext, TriggerEntry


def build(context: TriggerContext, settings: None) -> Trigger:
    return Trigger("always", Constant(), 0.0, Policy("question"))


ALWAYS = TriggerEntry(build)
