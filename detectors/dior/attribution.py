"""Integrated-Gradients attribution over a question's tokens (DioR §3.1.1, Eq. 1 and 3).

The attribution target is the probability of the first answer token. Only the question's token
embeddings are integrated from a zero baseline; the prompt template around them stays fixed, so the
attribution speaks about the question alone.

Speed: the interpolation steps of many questions go through the model together (``batch_size`` rows
of question × step per forward/backward pass, right-padded: causal attention keeps real positions
from seeing the padding), only each row's last real position reaches the output head, and the prompt
before the questions runs once (its key/value cache is shared by every row). One question is a batch
of one: serving and build_early run the same function.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from captum.attr._utils.approximation_methods import approximation_parameters
from transformers import PreTrainedModel

from detectors.llm.kv import KV, as_cache, prefix_kv
from detectors.llm.offsets import words_and_tokens

_EPS = 1e-12
CPU_ROWS = 64  # rows per pass on a CPU: larger batches stop paying (measured on 2 cores, SmolLM2-135M)


@dataclasses.dataclass
class IGItem:
    """One question's attribution problem after the shared cached prefix."""

    ids: torch.Tensor  # [T] token ids after the prefix
    mask: torch.Tensor  # [T] bool: the question's positions (integrated); the others stay at their embedding
    target: int  # the token whose probability is attributed


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The output head over final hidden states ``[R, H]`` (with the model's logit soft-capping, if any)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def auto_rows(model: PreTrainedModel, n_steps: int, tokens: int) -> int:
    """A memory-aware number of (question × step) rows per pass: on a GPU, what half its free memory holds
    of one row's saved activations (``tokens`` long); on a CPU, :data:`CPU_ROWS`. Never below ``n_steps``."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return max(CPU_ROWS, n_steps)
    cfg = model.config
    width = cfg.hidden_size * 12 + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size) * 3
    per_row = tokens * cfg.num_hidden_layers * width * next(model.parameters()).element_size()
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(max(n_steps, free // 2 // max(per_row, 1)), 4096))


def batch_token_attributions(
    model: PreTrainedModel,
    items: list[IGItem],
    n_steps: int,
    method: str = "gausslegendre",
    batch_size: int | None = None,
    prefix: KV | None = None,
) -> list[np.ndarray]:
    """Per-question-token IG attribution of each item: L2 norm over the embedding dimension, ``[n_question_tokens]``.

    The same quadrature as captum's ``IntegratedGradients`` (its ``method``), computed for ``batch_size``
    rows at a time (None: :func:`auto_rows`); a question's steps may span passes. ``prefix`` holds the
    key/value states of the prompt tokens before every item.
    """
    if not items:
        return []
    step_sizes, alphas = (f(n_steps) for f in approximation_parameters(method))
    embed, decoder = model.get_input_embeddings(), model.get_decoder()
    with torch.no_grad():
        inputs = [embed(it.ids[None])[0] for it in items]
    baselines = [x * (~it.mask)[:, None].to(x.dtype) for x, it in zip(inputs, items)]
    by_length = sorted(range(len(items)), key=lambda i: len(items[i].ids))  # less padding per pass
    rows = [(i, k) for i in by_length for k in range(n_steps)]
    rows_per_pass = batch_size or auto_rows(model, n_steps, max(len(it.ids) for it in items))
    grads: dict[int, list[torch.Tensor]] = {}
    out: list[np.ndarray | None] = [None] * len(items)
    for start in range(0, len(rows), rows_per_pass):
        chunk = rows[start : start + rows_per_pass]
        lengths = [len(items[i].ids) for i, _ in chunk]
        points = torch.zeros(
            len(chunk), max(lengths), inputs[0].shape[-1], dtype=inputs[0].dtype, device=inputs[0].device
        )
        for r, (i, k) in enumerate(chunk):
            points[r, : lengths[r]] = baselines[i] + alphas[k] * (inputs[i] - baselines[i])
        points.requires_grad_()
        cache = as_cache(prefix, len(chunk), model.config)
        hidden = decoder(inputs_embeds=points, past_key_values=cache, use_cache=cache is not None).last_hidden_state
        last = hidden[torch.arange(len(chunk)), torch.tensor(lengths, device=hidden.device) - 1]
        probs = torch.softmax(head_logits(model, last).float(), dim=-1)
        targets = torch.tensor([items[i].target for i, _ in chunk], device=probs.device)
        (grad,) = torch.autograd.grad(probs.gather(1, targets[:, None]).sum(), points)
        for r, (i, _) in enumerate(chunk):
            grads.setdefault(i, []).append(grad[r, : lengths[r]])
            if len(grads[i]) == n_steps:  # captum's reduction: step-weighted sum, times (input - baseline)
                steps = torch.tensor(step_sizes).float().view(n_steps, 1, 1).to(grad.device)
                total = (torch.stack(grads.pop(i)) * steps).sum(0)
                attr = total * (inputs[i] - baselines[i])
                out[i] = attr.float().norm(dim=-1)[items[i].mask].detach().cpu().numpy()
    return out  # type: ignore[return-value]


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
    """One question's attribution (``input_ids`` ``[1, L]``, ``question_mask`` ``[L]``): the prompt before the
    first question token is the cached prefix (pass ``prefix`` from :func:`prefix_kv` when the caller has it)."""
    start = int(question_mask.nonzero()[0, 0])
    if prefix is None:
        prefix = prefix_kv(model, input_ids, start)
    item = IGItem(input_ids[0, start:], question_mask[start:], target_id)
    return batch_token_attributions(model, [item], n_steps, method, batch_size, prefix)[0]


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


def keyword_candidates(text: str, offsets: list[int], p: np.ndarray) -> list[str]:
    """DioR Eq. 3: the whole words of the question holding a token whose attribution is above the mean, in question
    order, each once (case-insensitively).

    ``text`` is the question's tokens decoded together and ``offsets`` their character offsets in it
    (:func:`~detectors.llm.offsets.token_offsets`): words come from characters
    (:func:`~detectors.llm.offsets.words_and_tokens`), so a name whose UTF-8 bytes span tokens stays whole (Zürich, not
    a replacement character and "rich"), and a hot punctuation token makes no keyword of the word beside it.
    """
    mean = float(np.mean(p)) if len(p) else 0.0
    seen: dict[str, str] = {}
    for word, tokens in words_and_tokens(text, offsets):
        if any(float(p[i]) > mean for i in tokens):
            seen.setdefault(word.lower(), word)
    return list(seen.values())
