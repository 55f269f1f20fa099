"""Integrated-Gradients attribution over a question's tokens (DioR §3.1.1, Eq. 1 and 3).

The attribution target is the probability of the first answer token. Only the question's token
embeddings are integrated from a zero baseline; the prompt template around them stays fixed, so the
attribution speaks about the question alone. Speed: all interpolation steps go through the model in
one batch (``internal_batch_size``), only the last position's logits are computed, and the prompt
before the question runs once (its key/value cache is shared by all steps).
"""

from __future__ import annotations

import numpy as np
import torch
from captum.attr import IntegratedGradients
from transformers import PreTrainedModel

from detectors.llm.kv import KV, as_cache, prefix_states

_EPS = 1e-12


def first_token_probability(model: PreTrainedModel, target_id: int, prefix: KV | None = None):
    """``f(inputs_embeds) -> p(target | prompt)`` for each row of a batch, from the last position only.

    ``prefix`` holds the key/value states of the prompt tokens before the inputs; they are shared by
    every row, so they are computed once instead of once per interpolation step.
    """

    def forward(inputs_embeds: torch.Tensor) -> torch.Tensor:
        cache = as_cache(prefix, inputs_embeds.shape[0], model.config)
        logits = model(inputs_embeds=inputs_embeds, past_key_values=cache, logits_to_keep=1, use_cache=cache is not None).logits
        return torch.softmax(logits[:, -1].float(), dim=-1)[:, target_id]

    return forward


def token_attributions(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    question_mask: torch.Tensor,
    target_id: int,
    n_steps: int,
    method: str = "gausslegendre",
    batch_size: int | None = None,
    prefix: KV | None = None,
) -> np.ndarray:
    """Per-question-token IG attribution: L2 norm over the embedding dimension, shape ``[n_question_tokens]``.

    The prompt before the first question token is identical at every interpolation step (causal
    attention), so it runs once and its key/value states are reused by all steps; pass ``prefix``
    (from :func:`prefix_states`) when the caller already has them.
    """
    start = int(question_mask.nonzero()[0, 0])
    if prefix is None:
        prefix = prefix_states(model, input_ids, start)
    mask = question_mask[start:]
    embeds = model.get_input_embeddings()(input_ids[:, start:]).detach()
    baseline = embeds * (~mask)[None, :, None].to(embeds.dtype)
    ig = IntegratedGradients(first_token_probability(model, target_id, prefix))
    attr = ig.attribute(embeds, baselines=baseline, n_steps=n_steps, method=method, internal_batch_size=batch_size or n_steps)
    scores = attr[0].float().norm(dim=-1)[mask]
    return scores.detach().cpu().numpy()


def attribution_distribution(scores: np.ndarray) -> np.ndarray:
    """Normalise non-negative attributions to sum 1 (uniform when they are all zero)."""
    scores = np.clip(np.asarray(scores, dtype=np.float64), 0.0, None)
    total = scores.sum()
    if total <= _EPS:
        return np.full(len(scores), 1.0 / len(scores))
    return scores / total


def attribution_entropy(p: np.ndarray) -> float:
    """DioR Eq. 1: ``-sum p log p`` of the attribution distribution (log n when uniform, 0 when peaked)."""
    p = np.asarray(p, dtype=np.float64)
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def keyword_candidates(tokens: list[str], p: np.ndarray) -> list[str]:
    """DioR Eq. 3: words holding a token whose attribution is above the mean, in question order.

    ``tokens`` are the decoded question tokens; a token that starts with whitespace starts a new word,
    and punctuation tokens stand alone (a hot full stop makes no keyword of the word before it).
    """
    mean = float(np.mean(p)) if len(p) else 0.0
    words: list[tuple[str, bool]] = []
    for tok, score in zip(tokens, p):
        hot = float(score) > mean
        if not words or tok[:1].isspace() or not any(c.isalnum() for c in tok) or not any(c.isalnum() for c in words[-1][0]):
            words.append((tok, hot))
        else:
            text, was_hot = words[-1]
            words[-1] = (text + tok, was_hot or hot)
    seen: dict[str, None] = {}
    for text, hot in words:
        word = text.strip().strip(".,;:!?\"'()[]{}")
        if hot and word and word.lower() not in {w.lower() for w in seen}:
            seen[word] = None
    return list(seen)
