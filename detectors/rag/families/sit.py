"""Stitch-in-Time's triggers: ``sit_min`` (detection: an entity's minimum token probability, the comparison's scorer
over the real-time set's entities) and ``sit`` (the paper's procedure: the concepts the LLM names, validation of each
uncertain one, repair), and the calculators of the segment's concepts."""

from __future__ import annotations

import math
import re

import numpy as np

from detectors.baselines.stitch_in_time import SitMin, SitValidator
from detectors.config.triggers import SitParams
from detectors.errors import InputError
from detectors.interfaces import Level
from detectors.llm.generate import generate, instruction_prompt
from detectors.llm.loading import LLM
from detectors.llm.offsets import entity_tokens, token_offsets
from detectors.rag.controllers.validation import ValidateAndRepair
from detectors.rag.stats import Calculator, SegmentView
from detectors.rag.triggers import PROBABILITY, Policy, Trigger, TriggerContext, TriggerEntry


class EntityCalculator(Calculator):
    """``entities``: the token indices of each spaCy entity of the segment (the real-time set's entity tokens,
    :func:`~detectors.llm.offsets.entity_tokens`)."""

    key, provides = "entities", ("entities",)

    def __init__(self, llm: LLM, nlp):
        self.llm, self.nlp = llm, nlp

    def segments(self, views: list[SegmentView]) -> None:
        for v, doc in zip(views, self.nlp.pipe([v.text for v in views])):
            offsets = token_offsets(self.llm, v.gen_ids)
            spans = [entity_tokens(offsets, ent.start_char, ent.end_char) for ent in doc.ents]
            v.stats["entities"] = [np.asarray(s, dtype=np.int64) for s in spans if s]


def concept_spans(question: str, segment: str, offsets: list[int], named: str) -> list[list[int]]:
    """The token spans of the concepts the LLM ``named`` (a list split at commas and lines, numbering dropped) in the
    sentence ``question`` + ``segment``: each phrase found in the sentence covers the segment's tokens (``offsets``:
    :func:`~detectors.llm.offsets.token_offsets`) it overlaps; the part in the question was not generated."""
    sentence = f"{question.strip()} {segment.strip()}".lower()
    shift = len(question.strip()) + 1 - (len(segment) - len(segment.lstrip()))  # a sentence offset minus the segment's
    phrases = dict.fromkeys(
        re.sub(r"^\d+[.)]\s*", "", p.strip()).strip(" .;:\"'").lower() for p in re.split(r"[,\n]", named)
    )
    spans = []
    for phrase in (p for p in phrases if p and p in sentence):
        at = sentence.find(phrase)
        start, end = max(at - shift, 0), min(at + len(phrase) - shift, len(segment))
        span = entity_tokens(offsets, start, end) if start < end else []
        if span and span not in spans:
            spans.append(span)
    return spans


class ConceptCalculator(Calculator):
    """``entities`` as Stitch-in-Time's preferred technique finds concepts (§2.1.1): the LLM, instructed
    (``rag_eval.settings.sit.concepts_prompt``, Table 3), names the important keyphrases of the sentence (the question
    and the segment), greedily, the segments batched; each one's tokens in the segment are a concept
    (:func:`concept_spans`): ``concepts``, beside the entities ``sit_min`` reads."""

    key, provides = "concepts", ("concepts",)

    def __init__(self, llm: LLM, params):
        self.llm, self.params = llm, params

    def segments(self, views: list[SegmentView]) -> None:
        p = self.params
        prompts = [
            instruction_prompt(
                self.llm, p.concepts_prompt.format(sentence=f"{v.question.strip()} {v.text.strip()}"), p.chat
            )
            for v in views
        ]
        for v, named in zip(
            views, generate(self.llm, prompts, p.concept_tokens, add_special_tokens=not p.chat, stop=("\n\n",))
        ):
            v.stats["concepts"] = [
                np.asarray(s, dtype=np.int64)
                for s in concept_spans(v.question, v.text, token_offsets(self.llm, v.gen_ids), named.text)
            ]


def build_min(context: TriggerContext, settings: None) -> Trigger:
    return Trigger(
        "sit_min",
        SitMin(Level.ENTITY),
        math.inf,
        Policy("token"),
        (EntityCalculator(context.llm, context.nlp),),
        scores=PROBABILITY,
    )


def build(context: TriggerContext, settings: SitParams | None) -> Trigger:
    """Stitch-in-Time as its paper runs it: detect (§2.1.1-2.1.2: the concepts of ``settings.concepts``, each scored
    by its least probable token, as ``sit_min``), validate each uncertain concept (§2.1.3-2.1.5) and repair the
    sentence with the passages when one fails (§2.2; the repair is kept)."""
    if settings is None:
        raise InputError(
            "trigger 'sit' validates with rag_eval.settings.sit: give its params (concepts, validation_question, "
            "prompt, yes/no words, threshold)"
        )
    llm = context.llm
    policy = Policy("token", cut="segment", after_retrieval="accept")
    if settings.concepts == "llm":
        scorer, concepts = SitMin(Level.ENTITY, spans="concepts"), ConceptCalculator(llm, settings)
    else:
        scorer, concepts = SitMin(Level.ENTITY), EntityCalculator(llm, context.nlp)
    controller = ValidateAndRepair(SitValidator(llm, settings))
    return Trigger("sit", scorer, math.inf, policy, (concepts,), scores=PROBABILITY, controller=controller)


SIT_MIN = TriggerEntry(build_min, offline=SitMin)
SIT = TriggerEntry(build, SitParams)
