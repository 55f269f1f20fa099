"""RetroRAG's LLM-based evaluator S (Xiao et al., §Answerer, Eq. 1): ``P("yes") / (P("yes") + P("no"))`` of the next
token after a yes/no prompt (:func:`yes_probability`), and the two question-level scores the comparison reads from it:

- ``retrorag_self_consistency``, Eq. 1 as the paper computes it: a second answer a_sc is *sampled* (the
  SC-generator, at ``retrorag.sc_temperature``; no evidence on the early set) and the evaluator M_sc (Fig. 8) judges
  whether the LLM's greedy answer a and a_sc have the same meaning (low: the LLM is not self-consistent);
- ``retrorag_self_evaluation``, the evaluator asked whether the LLM's own answer is correct (Fig. 8's wording about
  one answer, ``score_baselines.evaluator``), named for what it computes.

``P("yes")`` sums the probabilities of the word's single-token variants: as given, lower case, capitalised and upper
case, each with and without a leading space (those that are one token in the LLM's vocabulary); ``P("no")`` likewise.
RetroRAG itself, the iterative framework around the evaluator, is :mod:`detectors.rag.retroactive`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from detectors.evaluation.scorers import ColumnScorer
from detectors.llm.generate import OnBatch, generate, instruction_prompt, row_generator
from detectors.llm.loading import LLM
from detectors.llm.states import StateCache, prefill

if TYPE_CHECKING:
    from detectors.config.retrorag import RetroRagParams
    from detectors.config.schema import PromptParams

NAME = "retrorag_self_evaluation"
CONSISTENCY = "retrorag_self_consistency"
RETRORAG_SELF_EVALUATION = ColumnScorer(NAME, NAME, higher_is_hallucinated=False, is_probability=False)
RETRORAG_SELF_CONSISTENCY = ColumnScorer(CONSISTENCY, CONSISTENCY, higher_is_hallucinated=False, is_probability=False)


def word_token_ids(tokenizer, words: list[str]) -> list[int]:
    """Ids of the single-token variants of ``words`` (as given, lower, Capitalised, UPPER; with and without a
    leading space), deduplicated. Raises ValueError naming the words when none is a single token."""
    ids: list[int] = []
    for word in words:
        for form in (word, word.lower(), word.capitalize(), word.upper()):
            for text in (form, " " + form):
                enc = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(enc) == 1 and enc[0] not in ids:
                    ids.append(enc[0])
    if not ids:
        raise ValueError(
            f"none of the words {words} (nor their casing/leading-space variants) is one token of the LLM: choose other words"
        )
    return ids


def yes_no_ids(tokenizer, yes: Sequence[str], no: Sequence[str]) -> tuple[list[int], list[int]]:
    """The token ids of the yes and no words (:func:`word_token_ids`); they must not share one."""
    yes_ids, no_ids = word_token_ids(tokenizer, list(yes)), word_token_ids(tokenizer, list(no))
    if set(yes_ids) & set(no_ids):
        raise ValueError(
            f"the yes words {list(yes)} and no words {list(no)} share tokens {sorted(set(yes_ids) & set(no_ids))}: choose other words"
        )
    return yes_ids, no_ids


def yes_probability(
    llm: LLM,
    prompts: list[str],
    yes_ids: list[int],
    no_ids: list[int],
    batch_size: int = 16,
    *,
    add_special_tokens: bool = True,
    on_batch: OnBatch | None = None,
    progress=None,
    cache: StateCache | None = None,
) -> np.ndarray:
    """The evaluator's verdict on each prompt: ``P(yes) / (P(yes) + P(no))`` of its next token (``yes_ids``/``no_ids``:
    :func:`yes_no_ids`).

    Each prompt runs on its longest prefix already run (:func:`~detectors.llm.states.prefill`): the prefixes several
    prompts share (an instruction, a reference) run once, and with a ``cache`` the states of earlier calls are reused
    and these prompts' kept. ``on_batch`` hears of each batched call: its row indices, forward calls and seconds (a
    shared prefix's pass is reported for every row it serves)."""
    if set(yes_ids) & set(no_ids):
        raise ValueError(f"the yes and no words share tokens {sorted(set(yes_ids) & set(no_ids))}: choose other words")
    if not prompts:
        return np.zeros(0)
    rows = [llm.tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts]
    out, step = np.zeros(len(rows)), max(batch_size, 1) * 8  # a progress update every `step` rows
    for start in range(0, len(rows), step):
        chunk = list(range(start, min(start + step, len(rows))))
        relay = (
            None
            if on_batch is None
            else (lambda idx, calls, seconds, chunk=chunk: on_batch([chunk[j] for j in idx], calls, seconds))
        )
        done = prefill(llm, [rows[i] for i in chunk], cache, batch_size, on_batch=relay)
        for i, logits in zip(chunk, done.logits):
            logp = torch.log_softmax(logits, dim=-1)
            out[i] = float(torch.sigmoid(torch.logsumexp(logp[yes_ids], 0) - torch.logsumexp(logp[no_ids], 0)))
        if progress is not None:
            progress.update(len(chunk))
    return out


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
    params: RetroRagParams,
    prompt: PromptParams,
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
