"""DRAGIN's RIND (Su et al. 2024, §3.1, Eq. 1-5): a generated token's real-time information need,
``S_RIND(t_i) = H_i · a_max(i) · s_i``, combined over a sentence's words as DRAGIN's released code does.

- ``H_i``: entropy (nats) of the distribution the token was drawn from (Eq. 1);
- ``a_max(i)``: the largest attention a token at or after it pays to it (Eq. 3). DRAGIN takes the last Transformer
  layer (footnote 2) and does not say how heads combine; as DRAGIN's released code does, each head's maximum is
  averaged over the heads. Eq. 3 takes the later tokens (j > i), which leaves the last generated token (and so any
  one-token answer) without a value; the released code (``src/generate.py``, ``generate_attn``) takes the max over
  every query row, the token's attention to itself included, and so does this. Later tokens are the segment's own
  (the prompt comes before every generated token); the attention is over the whole prompt + segment, the attention
  the LLM paid while generating (the released code reruns the generated tokens alone, without their prompt);
- ``s_i``: 0 when the token's word is a stop word or punctuation (spaCy's list, DRAGIN §4.5), else 1 (Eq. 4).

How a sentence's tokens combine is the released code's (``generate_attn`` and ``AttnWeightRAG.modifier``; the paper
is silent): tokens merge into whitespace-delimited words, a word's attention the sum of its tokens' ``a_max`` and
its entropy their mean; within each sentence the words' attentions are normalised to sum to the sentence's number
of words, and a word scores normalised attention × mean entropy × ``s`` (each of its tokens carries that score).
A one-word answer therefore scores its entropy.

:func:`rind_on_kv` scores a generated segment from the cached states of its prompt (only the generated tokens
run again, with eager attention, the only kind that returns attention weights) and the entropies recorded while
generating: the RAG loop's DRAGIN trigger, which judges each segment once it is generated. :func:`rind_scores` scores
stored continuations (the real-time set) with the same function, after running their prompts as the loop does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from detectors.evaluation.scorers import TokenStatScorer
from detectors.llm.kv import KV, as_cache, batches, stack_left
from detectors.llm.layers import attention_implementation, decoder_layers
from detectors.llm.loading import LLM
from detectors.llm.prefill import prefill
from detectors.llm.words import DEFAULT_STOPWORDS, sentence_of, spaced_words, word_mask

NAME = "rind"


@dataclasses.dataclass
class RindTrace:
    """RIND and its three factors for each token of one continuation."""

    entropy: np.ndarray  # [n] H_i (nats)
    attention: np.ndarray  # [n] a_max(i), last layer, heads averaged
    content: np.ndarray  # [n] s of the token's word (1.0 a content word, 0.0 stop words or punctuation only)
    rind: np.ndarray  # [n] the token's word's score: sentence-normalised attention × mean entropy × s


class _LastLayerAttention:
    """A forward hook on the last decoder block's attention keeping its weights ``[B, heads, T, T]``."""

    def __init__(self, model: torch.nn.Module):
        self.module = decoder_layers(model)[-1].self_attn
        self.weights: torch.Tensor | None = None

    def __enter__(self) -> _LastLayerAttention:
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, module, args, output) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise RuntimeError("the last attention layer returned no weights: RIND needs eager attention")
        self.weights = weights.detach()

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def rind_trace(llm: LLM, continuation: list[int], entropy, attention, stopwords: frozenset[str]) -> RindTrace:
    """Eq. 5 of one segment from its tokens' entropies ``H_i`` and attention maxima ``a_max(i)``, combined over each
    sentence's words as DRAGIN's released code does (see the module's docstring); ``content`` is each token's
    word's ``s``."""
    entropy, attention = np.asarray(entropy, dtype=np.float64), np.asarray(attention, dtype=np.float64)
    ids = list(continuation)
    token_content = np.asarray(word_mask(llm.tokenizer, ids, stopwords), dtype=np.float64)
    words = np.asarray(spaced_words(llm.tokenizer, ids), dtype=np.int64)
    n_words = int(words.max()) + 1 if len(words) else 0
    word_attention = np.bincount(words, attention, n_words)
    word_entropy = np.bincount(words, entropy, n_words) / np.bincount(words, minlength=n_words)
    word_content = np.zeros(n_words)
    np.maximum.at(word_content, words, token_content)
    texts = [
        llm.tokenizer.decode([ids[i] for i in np.flatnonzero(words == w)], skip_special_tokens=True)
        for w in range(n_words)
    ]
    sentences = np.asarray(sentence_of(texts), dtype=np.int64)
    total, size = np.bincount(sentences, word_attention), np.bincount(sentences)
    with np.errstate(invalid="ignore", divide="ignore"):
        normalised = np.nan_to_num(word_attention / total[sentences] * size[sentences])
    score = normalised * word_entropy * word_content
    return RindTrace(entropy, attention, word_content[words], score[words])


def later_attention_max(weights: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``a_max`` per position: ``max_{i<=j<length} A[j, i]`` per head (the token's attention to itself included, as
    DRAGIN's released code takes it), averaged over heads; ``[B, T]``.

    ``weights`` is ``[B, heads, T(query j), T(key i)]``; queries at or past a row's length (padding) are ignored.
    """
    T = weights.shape[-1]
    pos = torch.arange(T, device=weights.device)
    later = pos[:, None] >= pos[None, :]  # [j, i]: j at or after i
    real = pos[None, :] < lengths[:, None].to(weights.device)  # [B, j]
    keep = later[None] & real[:, :, None]  # [B, j, i]
    per_head = weights.float().masked_fill(~keep[:, None], 0.0).amax(dim=2)  # [B, heads, i]
    return per_head.mean(dim=1)


def rind_scores(
    llm: LLM,
    prompts: list[list[int]],
    continuations: list[list[int]],
    entropies: list,
    stopwords: frozenset[str] = DEFAULT_STOPWORDS,
    batch_size: int = 8,
    progress=None,
) -> list[RindTrace]:
    """RIND of every token of stored continuations, computed as the RAG loop's DRAGIN trigger computes it: each prompt
    runs once, its states kept (:func:`~detectors.llm.prefill.prefill`, the loop's prefill), and its continuation runs
    once more on them in one eager batch (:func:`rind_on_kv`, the trigger's calculator). ``entropies[k]`` holds
    ``H_i`` of each token of ``continuations[k]``, recorded when it was generated (the real-time set's ``entropy``).

    ``prompts[k]`` and ``continuations[k]`` are token ids (the prompt non-empty); rows of similar length run together.
    ``progress`` (a tqdm bar) is advanced by the number of rows done.
    """
    if not len(prompts) == len(continuations) == len(entropies):
        raise ValueError(
            f"rind_scores got {len(prompts)} prompts, {len(continuations)} continuations and {len(entropies)} entropy "
            f"rows: give one of each per record"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError(
            "rind_scores needs a non-empty prompt for every continuation (its last token predicts the first)"
        )
    for k, (c, e) in enumerate(zip(continuations, entropies)):
        if len(c) != len(e):
            raise ValueError(
                f"rind_scores: continuation {k} has {len(c)} tokens but {len(e)} recorded entropies (one per token)"
            )
    out: list[RindTrace | None] = [None] * len(prompts)
    for i, c in enumerate(continuations):
        if not c:  # nothing generated: nothing to score
            out[i] = rind_trace(llm, [], [], [], stopwords)
    todo = [i for i, c in enumerate(continuations) if c]
    rows = [list(prompts[i]) + list(continuations[i]) for i in todo]
    for chunk in batches(rows, batch_size):
        idx = [todo[b] for b in chunk]
        states = prefill(llm, [list(prompts[i]) for i in idx], batch_size=batch_size, keep_kv=True).kv
        traces = rind_on_kv(llm, states, [list(continuations[i]) for i in idx], [entropies[i] for i in idx], stopwords)
        for i, trace in zip(idx, traces):
            out[i] = trace
        if progress is not None:
            progress.update(len(idx))
    if progress is not None and len(todo) < len(prompts):
        progress.update(len(prompts) - len(todo))
    return out  # type: ignore[return-value]


def rind_on_kv(
    llm: LLM,
    contexts: list[KV],
    continuations: list[list[int]],
    entropies: list[np.ndarray],
    stopwords: frozenset[str] = DEFAULT_STOPWORDS,
) -> list[RindTrace]:
    """RIND of each continuation while the LLM generates it (the RAG loop's trigger): the continuation runs once more,
    in one eager batch, on the cached states of everything before it (``contexts``: per row, its key/value states), so
    only its own tokens are computed; ``H_i`` is the entropy recorded when each token was chosen. The one computation of
    RIND: the stored sets' scores (:func:`rind_scores`) come from it too."""
    lengths = [ctx[0][0].shape[2] for ctx in contexts]
    width, n = max(lengths), max(len(c) for c in continuations)
    pad = llm.tokenizer.pad_token_id or 0
    device = llm.device
    ids = torch.tensor([list(c) + [pad] * (n - len(c)) for c in continuations], device=device)
    # right padding: only padding attends to it
    mask = torch.tensor([[0] * (width - m) + [1] * (m + n) for m in lengths], device=device)
    positions = torch.tensor([[m + i for i in range(n)] for m in lengths], device=device)
    cache = as_cache(stack_left(contexts, width), len(contexts), llm.model.config)
    with torch.no_grad(), attention_implementation(llm.model, "eager"), _LastLayerAttention(llm.model) as tap:
        llm.model.get_decoder()(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    a_max = (
        later_attention_max(tap.weights[:, :, :, width:], torch.tensor([len(c) for c in continuations])).cpu().numpy()
    )
    return [
        rind_trace(llm, c, entropy, a_max[b, : len(c)], stopwords)
        for b, (c, entropy) in enumerate(zip(continuations, entropies))
    ]


@dataclasses.dataclass(frozen=True)
class Rind(TokenStatScorer):
    """RIND as a scorer of the real-time set's per-token stat ``rind``: a token scores its RIND, an entity its
    largest token's, a continuation its largest token's over all generated tokens (DRAGIN retrieves when
    any token exceeds the threshold)."""

    name: str = NAME
    stat: str = NAME

    def continuation(self, stats: dict[str, np.ndarray], entities: list[np.ndarray]) -> float:
        return float(np.max(stats[self.stat]))
