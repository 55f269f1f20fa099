"""The ``retrorag`` section: RetroRAG's prompts and numbers (Xiao et al.), read by ``rag_eval`` (the framework as a
configuration, :mod:`detectors.rag.retroactive`) and by ``score_baselines`` (Eq. 1's self-consistency score on the
early set's answers, :func:`detectors.baselines.retrorag.self_consistency_scores`)."""

from __future__ import annotations

import dataclasses
import math

from detectors.config.core import check_fields, fail, positive

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "retrorag": "RetroRagParams",
}

# template -> the fields it must hold, each exactly once (and no other braces)
TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "answer_context": ("evidence",),
    "direct_context": ("evidence",),
    "consistency_template": ("question", "answer", "sc_answer"),
    "relevance_template": ("evidence", "question"),
    "inference_template": ("question", "reference"),
    "question_relevance_template": ("evidence", "question"),
    "attribution_template": ("reference", "evidence"),
    "requery_template": ("question", "reference", "evidence", "reason"),
}


@dataclasses.dataclass(frozen=True)
class RetroRagParams:
    """RetroRAG's prompts (the appendix's Figs. 7-13, shortened) and numbers. The answer prompts (M_C
    ``answer_context``, M_D ``direct_context``) go right before ``{question}`` of the project's question prompt; every
    other prompt is an instruction, rendered as a user turn when ``chat``."""

    answer_context: str  # M_C, the answer-generator's evidence block: {evidence}
    direct_context: str  # M_D (Fig. 7), the SC-generator's evidence block: {evidence}
    consistency_template: str  # M_sc (Fig. 8): {question}, {answer}, {sc_answer}
    relevance_template: str  # M_e (Fig. 9): {evidence} (one item), {question} (q_m; q for inferential evidence)
    inference_template: str  # M_IE (Fig. 10): {question} (the "entity"), {reference} (one source evidence item)
    question_relevance_template: str  # M_qr (Fig. 11): {evidence} (a candidate), {question} (q_m)
    attribution_template: str  # M_ra (Fig. 12): {reference} (E_s), {evidence} (a candidate)
    requery_template: str  # M_R (Fig. 13): {question}, {reference} (E_s), {evidence} (E_i), {reason}
    no_evidence: str  # what {reference}/{evidence} of M_ra and M_R show for an empty list
    chat: bool  # the instruction prompts (M_sc, M_e, M_IE, M_qr, M_ra, M_R) as a user turn of the chat template
    yes_words: list[str]
    no_words: list[str]
    k: int  # passages per retrieval (paper: 5)
    top_n: int  # source evidence kept, E_s (paper: 5)
    top_k_inferential: int  # inferential evidence kept, E_i (paper: 5, as many as source evidence)
    max_iterations: int  # paper: 5
    threshold: float  # stop when s_sc > threshold (paper: 0.7; 0.5 on HotpotQA); >= 1: never (the paper's "w/o AE")
    gate: float  # Eq. 3: a candidate is kept when s_qr > gate and s_ra > gate (paper: 0.5)
    sc_temperature: float  # the SC-generator's temperature (paper: 1.0)
    answer_tokens: int  # tokens of an answer (a and a_sc; as rag_eval.max_new_tokens)
    reason_tokens: int  # tokens the answer-generator writes in all (the reason r); >= answer_tokens
    evidence_tokens: int  # tokens of an inferential evidence generation (M_IE) and of a search query (M_R)
    evidence_words: int  # every evidence item is shown truncated to this many words
    seed: int  # the SC-generator's samples: one generator per (seed, question index, iteration)

    def check(self, where: str) -> None:
        for key, fields in TEMPLATE_FIELDS.items():
            check_fields(f"{where}.{key}", getattr(self, key), fields)
        for key in ("yes_words", "no_words"):
            words = getattr(self, key)
            if not words or not all(isinstance(w, str) and w.strip() for w in words):
                fail(f"{where}.{key}", words, 'list at least one non-empty word, quoted in YAML ("yes", "no")')
        for key in (
            "k",
            "top_n",
            "top_k_inferential",
            "max_iterations",
            "answer_tokens",
            "evidence_tokens",
            "evidence_words",
        ):
            positive(f"{where}.{key}", getattr(self, key))
        if self.reason_tokens < self.answer_tokens:
            fail(
                f"{where}.reason_tokens",
                self.reason_tokens,
                f"must be >= answer_tokens ({self.answer_tokens}): the reason continues the answer",
            )
        if not math.isfinite(self.threshold):
            fail(
                f"{where}.threshold",
                self.threshold,
                "must be a number (s_sc is in [0, 1]; >= 1 never stops early, < 0 always stops after one iteration)",
            )
        if not 0 <= self.gate <= 1:
            fail(f"{where}.gate", self.gate, "an evaluator score threshold must be in [0, 1] (paper: 0.5)")
        if not (math.isfinite(self.sc_temperature) and self.sc_temperature > 0):
            fail(
                f"{where}.sc_temperature",
                self.sc_temperature,
                "the SC-generator's temperature must be positive (paper: 1.0)",
            )
        if self.seed < 0:
            fail(f"{where}.seed", self.seed, "must be a non-negative integer")
