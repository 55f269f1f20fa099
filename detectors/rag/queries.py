"""Query formulation: what to retrieve once a trigger fired.

- the question itself (single-round RAG; the sweep's fixed query);
- FLARE's masked query, as DRAGIN §5.4 describes it: the question and the tentative segment without its
  low-probability words;
- DRAGIN's QFS (§3.2): the words the flagged token attends to most (last layer, mean over heads), in text order;
- DioR's pre-retrieval importance score (§3.3.1) over the detectors' keyword candidates;
- CtrlA's masked query (Eq. 3) is :func:`detectors.ctrla.monitor.masked_query`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from detectors.llm.loading import LLM
from detectors.llm.words import DEFAULT_STOPWORDS, word_mask, word_spans
from detectors.sources.text import normalize_text


@dataclasses.dataclass(frozen=True)
class DiorWeights:
    """DioR §3.3.1: weights of the attention, TF-IDF, relative-position and question-similarity terms."""

    attention: float
    tfidf: float
    position: float
    similarity: float


def question_query(question: str) -> str:
    return question.strip()


def flare_query(tokenizer, question: str, gen_ids: list[int], probs: np.ndarray, theta: float) -> str:
    """The question and the segment without the words that hold a token of probability below ``theta``."""
    kept = [text for idx, text in word_spans(tokenizer, gen_ids) if min(float(probs[i]) for i in idx) >= theta]
    return f"{question.strip()} {''.join(kept).strip()}".strip()


def last_layer_attention(llm: LLM, ids: list[int]) -> np.ndarray:
    """``[T, T]`` last-layer self-attention of ``ids`` averaged over heads (one eager pass; the model's attention
    implementation is restored afterwards)."""
    from detectors.baselines.rind import attention_implementation

    with torch.no_grad(), attention_implementation(llm.model, "eager"):
        out = llm.model(torch.tensor([ids], device=llm.device), output_attentions=True)
    return out.attentions[-1][0].float().mean(0).cpu().numpy()


def qfs_query(llm: LLM, context_ids: list[int], position: int, top_n: int, stopwords: frozenset[str] = DEFAULT_STOPWORDS) -> str:
    """DRAGIN QFS: the ``top_n`` content tokens before ``position`` that the token at ``position`` attends to most,
    their words in text order (the whole context when nothing precedes it)."""
    tok = llm.tokenizer
    if position <= 0:
        return tok.decode(context_ids[: position + 1], skip_special_tokens=True).strip()
    row = last_layer_attention(llm, context_ids[: position + 1])[position, :position]
    before = context_ids[:position]
    content = np.asarray(word_mask(tok, before, stopwords), dtype=bool)
    ranked = [i for i in np.argsort(-row, kind="stable") if content[i]][:top_n]
    chosen = set(int(i) for i in ranked)
    words = [text.strip() for idx, text in word_spans(tok, before) if chosen & set(idx)]
    return " ".join(dict.fromkeys(w for w in words if w)) or tok.decode(before, skip_special_tokens=True).strip()


def _minmax(x: np.ndarray) -> np.ndarray:
    span = x.max() - x.min() if len(x) else 0.0
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def importance_scores(llm: LLM, question: str, context_ids: list[int], candidates: list[str], weights: DiorWeights,
                      idf: Callable[[str], float]) -> np.ndarray:  # fmt: skip
    """DioR's I_i for each candidate: ``w_a·A + w_t·TFIDF + w_p·P + w_s·S``, each term min-max normalised over the
    candidates. A: attention the candidate's tokens receive from later tokens (last layer, mean over heads and
    positions); TFIDF: its count among the context's words × ``idf``; P: Pos/N of its last occurrence; S: cosine
    similarity of its and the question's mean input embeddings. A candidate absent from the context has A = P = 0."""
    tok = llm.tokenizer
    words = word_spans(tok, context_ids)
    norms = [normalize_text(text) for _, text in words]
    attn = last_layer_attention(llm, context_ids) if len(context_ids) > 1 else np.zeros((len(context_ids), len(context_ids)))
    received = np.array([attn[i + 1 :, i].mean() if i + 1 < len(context_ids) else 0.0 for i in range(len(context_ids))])
    emb = llm.model.get_input_embeddings().weight.detach()
    q_ids = tok(question, add_special_tokens=False)["input_ids"]
    q_vec = emb[q_ids].float().mean(0) if q_ids else None
    terms = np.zeros((4, len(candidates)))
    for c, cand in enumerate(candidates):
        key = normalize_text(cand)
        where = [w for w, n in enumerate(norms) if n == key and key]
        if where:
            terms[0, c] = float(np.mean([received[i] for w in where for i in words[w][0]]))
            terms[2, c] = (where[-1] + 1) / len(words)
        terms[1, c] = len(where) * idf(cand)
        c_ids = tok(" " + cand.strip(), add_special_tokens=False)["input_ids"]
        if c_ids and q_vec is not None:
            terms[3, c] = float(torch.nn.functional.cosine_similarity(emb[c_ids].float().mean(0), q_vec, dim=0))
    w = np.array([weights.attention, weights.tfidf, weights.position, weights.similarity])
    return w @ np.stack([_minmax(t) for t in terms])


def dior_query(llm: LLM, question: str, context_ids: list[int], candidates: list[str], weights: DiorWeights,
               idf: Callable[[str], float], top: int) -> str:  # fmt: skip
    """The question followed by the ``top`` candidates by DioR's importance score (ties: the candidates' order)."""
    candidates = list(dict.fromkeys(c.strip() for c in candidates if c.strip()))
    if not candidates:
        return question.strip()
    scores = importance_scores(llm, question, context_ids, candidates, weights, idf)
    order = np.argsort(-scores, kind="stable")[:top]
    return f"{question.strip()} {' '.join(candidates[i] for i in order)}".strip()
