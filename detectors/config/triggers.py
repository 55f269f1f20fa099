"""The settings types of the RAG triggers that have settings of their own (``rag_eval.settings.<entry name>``, declared
by their :class:`~detectors.rag.triggers.TriggerEntry`): Stitch-in-Time's validation and CtrlA's refusal handling.
Apart from :mod:`.rag`, which checks the entries' names, so that the trigger modules import their types without a
cycle through the registries."""

from __future__ import annotations

import dataclasses
from typing import Literal

from detectors.config.core import check_fields, fail, positive


@dataclasses.dataclass(frozen=True)
class SitParams:
    """Stitch-in-Time's ``sit`` trigger: its concepts (§2.1.1; ``llm``: the keyphrases the LLM names when instructed
    with ``concepts_prompt`` (``{sentence}``; as a chat turn with ``chat``, at most ``concept_tokens`` tokens), the
    paper's preferred technique; ``entities``: spaCy's entities of the segment) and the validation of the uncertain
    ones (§2.1.3-2.1.5): the yes/no ``validation_question`` about a concept (``{question}``, ``{sentence}``,
    ``{concept}``; it is also the retrieval query), the ``prompt`` that answers it from the passages (``{passages}``,
    ``{validation_question}``), its yes/no words, and the P(yes) at or above which a concept passes (below: the
    sentence is repaired with the passages)."""

    concepts: Literal["llm", "entities"]
    concepts_prompt: str
    chat: bool
    concept_tokens: int
    validation_question: str
    prompt: str
    yes_words: list[str]
    no_words: list[str]
    threshold: float

    def check(self, where: str) -> None:
        check_fields(f"{where}.concepts_prompt", self.concepts_prompt, ("sentence",))
        positive(f"{where}.concept_tokens", self.concept_tokens)
        check_fields(
            f"{where}.validation_question", self.validation_question, ("question", "sentence", "concept"), ("concept",)
        )
        check_fields(f"{where}.prompt", self.prompt, ("passages", "validation_question"))
        for key in ("yes_words", "no_words"):
            words = getattr(self, key)
            if not words or not all(isinstance(w, str) and w.strip() for w in words):
                fail(f"{where}.{key}", words, 'list at least one non-empty word, quoted in YAML ("yes", "no")')
        if not 0 < self.threshold < 1:
            fail(f"{where}.threshold", self.threshold, "a probability in (0, 1), e.g. 0.5")


@dataclasses.dataclass(frozen=True)
class CtrlARefusalParams:
    """CtrlA's refusal handling H_R in the loop (App. B.3, Alg. 2-3): when the segment re-predicted after a retrieval
    still refuses (the detector's refusal patterns), the query is rewritten (f_QR: ``rewrite_template``, Prompt B.2,
    ``{question}`` and the previous ``{query}``; greedy, ``query_tokens`` tokens, its first line) and the segment
    re-predicted with the new passages, up to ``max_attempts`` (K) times."""

    rewrite_template: str
    chat: bool  # the rewrite prompt as a user turn of the chat template
    max_attempts: int
    query_tokens: int

    def check(self, where: str) -> None:
        check_fields(f"{where}.rewrite_template", self.rewrite_template, ("question", "query"))
        if self.max_attempts < 0:
            fail(f"{where}.max_attempts", self.max_attempts, "must be >= 0 (0: a refusal after a retrieval is kept)")
        positive(f"{where}.query_tokens", self.query_tokens)
