"""An LLM as a yes/no judge: ``P("yes") / (P("yes") + P("no"))`` of the next token after a yes/no prompt
(:func:`yes_probability`), the evaluator S of RetroRAG ("Retrieval-Augmented Generation by Evidence Retroactivity in
LLMs", arXiv 2501.05475, §Answerer, Eq. 1).

It is generic: RetroRAG's question-level scores (:mod:`detectors.baselines.retrorag`), Stitch-in-Time's concept
validation (:mod:`detectors.baselines.stitch_in_time`) and the retroactive RAG loop (:mod:`detectors.rag.retroactive`)
all ask the LLM a yes/no question, so the judge sits beside the LLM rather than inside one paper's package.

``P("yes")`` sums the probabilities of the word's single-token variants: as given, lower case, capitalised and upper
case, each with and without a leading space (those that are one token in the LLM's vocabulary); ``P("no")`` likewise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from detectors.llm.generate import OnBatch
from detectors.llm.loading import LLM
from detectors.llm.prefill import KVCache, prefill


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
            f"none of the words {words} (nor their casing/leading-space variants) is one token of the LLM: choose "
            f"other words"
        )
    return ids


def yes_no_ids(tokenizer, yes: Sequence[str], no: Sequence[str]) -> tuple[list[int], list[int]]:
    """The token ids of the yes and no words (:func:`word_token_ids`); they must not share one."""
    yes_ids, no_ids = word_token_ids(tokenizer, list(yes)), word_token_ids(tokenizer, list(no))
    if set(yes_ids) & set(no_ids):
        raise ValueError(
            f"the yes words {list(yes)} and no words {list(no)} share tokens "
            f"{sorted(set(yes_ids) & set(no_ids))}: choose other words"
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
    cache: KVCache | None = None,
) -> np.ndarray:
    """The evaluator's verdict on each prompt: ``P(yes) / (P(yes) + P(no))`` of its next token (``yes_ids``/``no_ids``:
    :func:`yes_no_ids`).

    Each prompt runs on its longest prefix already run (:func:`~detectors.llm.prefill.prefill`): the prefixes several
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
