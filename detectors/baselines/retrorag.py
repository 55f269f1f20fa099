"""The two question-level scores the comparison reads from RetroRAG's LLM-based evaluator S (Xiao et al., §Answerer,
Eq. 1: ``P("yes") / (P("yes") + P("no"))`` of the next token after a yes/no prompt, the generic judge
:func:`detectors.llm.judge.yes_probability`):

- ``retrorag_self_consistency``, Eq. 1 as the paper computes it: a second answer a_sc is *sampled* (the
  SC-generator, at ``retrorag.sc_temperature``; no evidence on the early set) and the evaluator M_sc (Fig. 8) judges
  whether the LLM's greedy answer a and a_sc have the same meaning (low: the LLM is not self-consistent);
- ``retrorag_self_evaluation``, the evaluator asked whether the LLM's own answer is correct (Fig. 8's wording about
  one answer, ``score_baselines.evaluator``), named for what it computes.

RetroRAG itself, the iterative framework around the evaluator, is :mod:`detectors.rag.retroactive`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from detectors.evaluation.scorers import ColumnScorer
from detectors.llm.generate import generate, instruction_prompt, row_generator
from detectors.llm.judge import yes_no_ids, yes_probability
from detectors.llm.loading import LLM

NAME = "retrorag_self_evaluation"
CONSISTENCY = "retrorag_self_consistency"
RETRORAG_SELF_EVALUATION = ColumnScorer(NAME, NAME, higher_is_hallucinated=False, is_probability=False)
RETRORAG_SELF_CONSISTENCY = ColumnScorer(CONSISTENCY, CONSISTENCY, higher_is_hallucinated=False, is_probability=False)


def self_evaluation_scores(
    llm: LLM,
    pairs: list[tuple[str, str]],
    template: str,
    chat: bool = False,
    yes: tuple[str, ...] = ("yes",),
    no: tuple[str, ...] = ("no",),
    batch_size: int = 16,
    progress=None,
) -> np.ndarray:
    """``retrorag_self_evaluation``: the evaluator's P(yes) that each ``(question, answer)`` is correct (``template``:
    ``{question}``, ``{answer}``)."""
    yes_ids, no_ids = yes_no_ids(llm.tokenizer, yes, no)
    prompts = [instruction_prompt(llm, template.format(question=q, answer=a), chat) for q, a in pairs]
    return yes_probability(llm, prompts, yes_ids, no_ids, batch_size, add_special_tokens=not chat, progress=progress)


def self_consistency_scores(
    llm: LLM,
    questions: list[str],
    answers: list[str],
    params: Any,  # detectors.config.retrorag.RetroRagParams (baselines sit below config)
    prompt: Any,  # detectors.config.schema.PromptParams
    batch_size: int = 16,
    progress=None,
) -> np.ndarray:
    """``retrorag_self_consistency``, Eq. 1 without evidence, for answers the LLM already gave with the question prompt
    ``prompt`` (the early set's greedy answers): a_sc is sampled from the same prompt (M_D with no evidence: the
    question prompt itself) for ``params.answer_tokens`` tokens at ``params.sc_temperature``, seeded as RetroRAG's first
    iteration of the question (``params.seed``, its text, iteration 0), cut at the first newline; then M_sc
    (``params.consistency_template``) judges whether ``answers`` and a_sc agree: ``P(yes) / (P(yes) + P(no))``."""
    if len(questions) != len(answers):
        raise ValueError(f"{len(questions)} questions but {len(answers)} answers")
    if not questions:
        return np.zeros(0)
    yes_ids, no_ids = yes_no_ids(llm.tokenizer, params.yes_words, params.no_words)
    prompts = [llm.render(q, prompt)[0] for q in questions]
    samples = generate(
        llm,
        prompts,
        params.answer_tokens,
        add_special_tokens=not prompt.chat,
        stop=("\n",),
        batch_size=batch_size,
        generators=[row_generator(params.seed, q, 0) for q in questions],
        temperature=params.sc_temperature,
    )
    judged = [
        instruction_prompt(llm, params.consistency_template.format(question=q, answer=a, sc_answer=g.text), params.chat)
        for q, a, g in zip(questions, answers, samples)
    ]
    return yes_probability(
        llm, judged, yes_ids, no_ids, batch_size, add_special_tokens=not params.chat, progress=progress
    )
