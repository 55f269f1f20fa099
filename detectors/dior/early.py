"""Early-detection features of a question (DioR §3.1.1): one function shared by build_early and serving."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from detectors.config.schema import EarlyFeatureParams
from detectors.dior.attribution import attribution_distribution, attribution_entropy, keyword_candidates, token_attributions
from detectors.errors import RecordError
from detectors.llm.kv import as_cache, prefix_states
from detectors.llm.layers import hidden_state_indices
from detectors.llm.loading import LLM
from detectors.sources.text import contains_reference


@dataclasses.dataclass
class QuestionFeatures:
    question_tokens: list[str]
    attribution: np.ndarray  # distribution over question tokens, sums to 1
    entropy: float  # attribution entropy (Eq. 1)
    keywords: list[str]  # keyword candidates (Eq. 3)
    first_token_id: int
    first_token_prob: float
    first_token_entropy: float
    first_token_margin: float  # p(top1) - p(top2)
    hidden: np.ndarray  # last prompt position, chosen layers concatenated
    cache: Any  # key/value cache of the whole prompt, to continue generation from


def question_features(llm: LLM, question: str, params: EarlyFeatureParams) -> QuestionFeatures:
    """Features of ``question`` before any answer token is generated."""
    if not question or not question.strip():
        raise RecordError("empty question")
    layers = hidden_state_indices(params.hidden_layers, llm.fingerprint.num_layers, "build_early.features.hidden_layers")
    ids, mask = llm.encode_prompt(question, params.prompt)
    n_question = int(mask.sum())
    if n_question == 0:
        raise RecordError("the question has no tokens after tokenisation")
    if n_question > params.max_question_tokens:
        raise RecordError(f"question has {n_question} tokens > max_question_tokens={params.max_question_tokens}")
    max_len = getattr(llm.model.config, "max_position_embeddings", None)
    if max_len is not None and ids.shape[1] >= max_len:
        raise RecordError(f"prompt has {ids.shape[1]} tokens, the LLM's context is {max_len}")
    # one pass over the prompt: the part before the question is cached for IG, the rest continues it
    start = int(mask.nonzero()[0, 0])
    prefix = prefix_states(llm.model, ids, start)
    with torch.no_grad():
        out = llm.model(
            ids[:, start:],
            past_key_values=as_cache(prefix, 1, llm.model.config),
            output_hidden_states=True,
            logits_to_keep=1,
            use_cache=True,
        )
    probs = torch.softmax(out.logits[0, -1].float(), dim=-1)
    top2 = torch.topk(probs, 2)
    first_id = int(top2.indices[0])
    hidden = torch.cat([out.hidden_states[layer][0, -1].float() for layer in layers]).cpu().numpy()
    scores = token_attributions(llm.model, ids, mask, first_id, params.n_steps, params.method, params.ig_batch_size, prefix)
    p = attribution_distribution(scores)
    tokens = [llm.tokenizer.decode([t]) for t in ids[0][mask].tolist()]
    return QuestionFeatures(
        question_tokens=tokens,
        attribution=p.astype(np.float32),
        entropy=attribution_entropy(p),
        keywords=keyword_candidates(tokens, p),
        first_token_id=first_id,
        first_token_prob=float(top2.values[0]),
        first_token_entropy=float(-(probs * torch.log(probs.clamp_min(1e-30))).sum()),
        first_token_margin=float(top2.values[0] - top2.values[1]),
        hidden=hidden.astype(np.float32),
        cache=out.past_key_values,
    )


def greedy_answer(llm: LLM, f: QuestionFeatures, max_new_tokens: int, stop: list[str] = ()) -> str:
    """The LLM's greedy continuation of the prompt up to the first stop string or end of sequence.

    Continues from the prompt's cache and first token in ``f``, so the prompt is not run again.
    """
    eos = llm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) - {None}
    cache, token, tokens = f.cache, f.first_token_id, []
    with torch.no_grad():
        while token not in eos:
            tokens.append(token)
            text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
            if len(tokens) >= max_new_tokens or any(s in text for s in stop):
                break
            out = llm.model(torch.tensor([[token]], device=llm.device), past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
    text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    for s in stop:  # the answer is what comes before the first stop string
        text = text.split(s, 1)[0]
    return text.strip()


def early_record(
    llm: LLM, question: str, answers: list[str], features: EarlyFeatureParams, max_new_tokens: int, stop: list[str]
) -> dict:
    """One row of the early-detection set: features, greedy answer and the containment label.

    ``label`` is 1 for a hallucination (no reference answer contained in the answer), 0 otherwise.
    """
    f = question_features(llm, question, features)
    answer = greedy_answer(llm, f, max_new_tokens, stop)
    return {"answer": answer, "label": int(not contains_reference(answer, answers)), **features_to_row(f)}


def features_to_row(f: QuestionFeatures) -> dict:
    """The stored columns of a question's features (the early-detection set's schema)."""
    return {
        "question_tokens": f.question_tokens,
        "attribution": f.attribution.tolist(),
        "entropy": f.entropy,
        "keywords": f.keywords,
        "first_token_prob": f.first_token_prob,
        "first_token_entropy": f.first_token_entropy,
        "first_token_margin": f.first_token_margin,
        "hidden": f.hidden.tolist(),
    }


SEQUENCE_DIM = 4  # per question token: p, p*n, log(p*n), relative position


def sequence_features(attribution) -> np.ndarray:
    """Per-token inputs of the GRU from an attribution distribution."""
    p = np.asarray(attribution, dtype=np.float64)
    n = len(p)
    rel = p * n
    pos = np.arange(n) / max(n - 1, 1)
    return np.stack([p, rel, np.log(np.clip(rel, 1e-6, None)), pos], axis=1).astype(np.float32)


def scalar_features(row: dict, groups: list[str]) -> np.ndarray:
    """The per-question scalars fed straight to the detector's head, in a fixed group order."""
    parts: list[np.ndarray] = []
    if "entropy" in groups:
        n = len(row["attribution"])
        log_n = float(np.log(n)) if n > 1 else 1.0
        parts.append(np.array([row["entropy"], row["entropy"] / log_n, log_n]))
    if "first_token" in groups:
        prob = float(row["first_token_prob"])
        parts.append(np.array([prob, np.log(max(prob, 1e-9)), row["first_token_entropy"], row["first_token_margin"]]))
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, dtype=np.float32)


def vector_features(row: dict, groups: list[str]) -> np.ndarray:
    """The per-question vector (hidden state of the last prompt token) the head sees through a projection."""
    return np.asarray(row["hidden"], dtype=np.float32) if "hidden" in groups else np.zeros(0, dtype=np.float32)
