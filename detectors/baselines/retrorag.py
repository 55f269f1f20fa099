"""RetroRAG's LLM-based evaluator (Xiao et al., §Answerer, Eq. 1) asked about the LLM's own answer, a question-level
score named for what it computes, ``retrorag_self_evaluation``: the LLM is asked whether its own answer to the
question is correct, and the score is ``P("yes") / (P("yes") + P("no"))`` of the next token (low: the LLM doubts its
answer).

It is not RetroRAG's self-consistency score: Eq. 1 asks the evaluator whether the answer agrees with a second answer
a_sc, sampled at a high temperature with a direct-answering prompt, and RetroRAG is a whole iterative framework
(answerer, evidence collation and discovery, re-query) around it. The early set holds one greedy answer per question,
so the prompt (``score_baselines.evaluator.template``) asks about that answer itself, in Fig. 8's wording. ``P("yes")`` sums the probabilities of the word's
single-token variants: as given, lower case, capitalised and upper case, each with and without a leading
space (those that are one token in the LLM's vocabulary); ``P("no")`` likewise.
"""

from __future__ import annotations

import numpy as np
import torch

from detectors.evaluation.scorers import ColumnScorer
from detectors.llm.kv import batches, forward_rows, prefix_cache, shared_prefix_length
from detectors.llm.loading import LLM

NAME = "retrorag_self_evaluation"
RETRORAG_SELF_EVALUATION = ColumnScorer(NAME, NAME, higher_is_hallucinated=False, is_probability=False)


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
        raise ValueError(f"none of the words {words} (nor their casing/leading-space variants) is one token of the LLM: choose other words")
    return ids


def render_evaluator(llm: LLM, template: str, question: str, answer: str, chat: bool) -> str:
    """The evaluator prompt for one (question, answer); with ``chat`` a user turn followed by the assistant's header."""
    content = template.format(question=question, answer=answer)
    if not chat:
        return content
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def yes_probability(llm: LLM, prompts: list[str], yes_ids: list[int], no_ids: list[int], add_special_tokens: bool = True,
                    batch_size: int = 16, progress=None) -> np.ndarray:  # fmt: skip
    """``P(yes) / (P(yes) + P(no))`` of the LLM's next token after each prompt (``yes_ids``/``no_ids``: the words'
    single-token variants, :func:`word_token_ids`): an LLM-based evaluator's verdict as a probability.

    The token prefix shared by all prompts (an instruction) runs once; rows are batched by length.
    """
    if set(yes_ids) & set(no_ids):
        raise ValueError(f"the yes and no words share tokens {sorted(set(yes_ids) & set(no_ids))}: choose other words")
    if not prompts:
        return np.zeros(0)
    rows = [llm.tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts]
    common = min(shared_prefix_length(rows), min(len(r) for r in rows) - 1)  # every row runs at least its last token
    kv = prefix_cache(llm, rows[0][:common])
    out = np.zeros(len(rows))
    for idx in batches([r[common:] for r in rows], batch_size):
        logits = forward_rows(llm, kv, [rows[i][common:] for i in idx], logits=True).logits
        for b, i in enumerate(idx):
            logp = torch.log_softmax(logits[b, len(rows[i]) - common - 1].float(), dim=-1)
            out[i] = float(torch.sigmoid(torch.logsumexp(logp[yes_ids], 0) - torch.logsumexp(logp[no_ids], 0)))
        if progress is not None:
            progress.update(len(idx))
    return out


def self_evaluation_scores(
    llm: LLM, pairs: list[tuple[str, str]], template: str, chat: bool = False, yes: tuple[str, ...] = ("yes",),
    no: tuple[str, ...] = ("no",), batch_size: int = 16, progress=None,
) -> np.ndarray:
    """``P(yes) / (P(yes) + P(no))`` of the evaluator's next token for each ``(question, answer)``."""  # fmt: skip
    yes_ids, no_ids = word_token_ids(llm.tokenizer, list(yes)), word_token_ids(llm.tokenizer, list(no))
    if set(yes_ids) & set(no_ids):
        raise ValueError(f"the yes words {list(yes)} and no words {list(no)} share tokens {sorted(set(yes_ids) & set(no_ids))}")
    prompts = [render_evaluator(llm, template, q, a, chat) for q, a in pairs]
    return yes_probability(llm, prompts, yes_ids, no_ids, not chat, batch_size, progress)
