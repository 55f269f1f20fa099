"""Stitch-in-Time's triggers: ``sit_min`` (detection: an entity's minimum token probability) and ``sit`` (detection,
validation of each uncertain concept, repair), and the calculator of the segment's entities."""

from __future__ import annotations

import numpy as np
import spacy

from detectors.baselines.stitch_in_time import SitMin, SitValidator
from detectors.dior.entities import entity_tokens, token_offsets
from detectors.errors import InputError
from detectors.interfaces import Level
from detectors.llm.loading import LLM
from detectors.rag.stats import Calculator, SegmentView
from detectors.rag.triggers import PROBABILITY, Policy, Trigger


class EntityCalculator(Calculator):
    """``entities``: the token indices of each spaCy entity of the segment (the real-time set's entity tokens,
    :func:`~detectors.dior.entities.entity_tokens`)."""
    key, provides = "entities", ("entities",)

    def __init__(self, llm: LLM, nlp):
        self.llm, self.nlp = llm, nlp

    def segments(self, views: list[SegmentView]) -> None:
        for v, doc in zip(views, self.nlp.pipe([v.text for v in views])):
            offsets = token_offsets(self.llm, v.gen_ids)
            spans = [entity_tokens(offsets, ent.start_char, ent.end_char) for ent in doc.ents]
            v.stats["entities"] = [np.asarray(s, dtype=np.int64) for s in spans if s]


def build_min(llm: "LLM", threshold: float | None, spacy_model: str, settings: object) -> Trigger:
    return Trigger("sit_min", SitMin(Level.ENTITY), threshold, Policy("token"), (EntityCalculator(llm, spacy.load(spacy_model)),), scores=PROBABILITY)


def build(llm: "LLM", threshold: float | None, spacy_model: str, settings: object) -> Trigger:
    """Stitch-in-Time as its paper runs it: detect (§2.1.1-2.1.2, as ``sit_min``), validate each uncertain concept
    (§2.1.3-2.1.5) and repair the sentence with the passages when one fails (§2.2; the repair is kept)."""
    if settings.sit is None:
        raise InputError("trigger 'sit' validates with rag_eval.sit: give its params (validation_question, prompt, yes/no words, threshold)")
    policy = Policy("token", cut="segment", after_retrieval="accept")
    return Trigger("sit", SitMin(Level.ENTITY), threshold, policy, (EntityCalculator(llm, spacy.load(spacy_model)),), scores=PROBABILITY,
                   validator=SitValidator(llm, settings.sit))  # fmt: skip
