"""Query formulation: what to retrieve once a trigger fired.

A formulation reads the question, the answer tokens kept so far and, when a token trigger fired, the segment with its
statistics (:class:`~detectors.rag.stats.SegmentView`) and the position it fired at; ``needs`` names the segment
statistics it cannot do without (the loop refuses a configuration whose triggers provide none of them).

- :class:`QuestionQuery`: the question itself (single-round RAG; the sweep's fixed query);
- :class:`FlareQuery`: FLARE's masked query, as DRAGIN's Table 1 describes it: the last generated sentence (the
  tentative segment) without its low-probability words;
- :class:`QfsQuery`: DRAGIN's QFS (§3.2): the words the flagged token attends to most (last layer, mean over heads),
  in text order;
- :class:`DiorQuery`: DioR's pre-retrieval importance score (§3.3.1) over the detectors' keyword candidates (the
  early detector's Eq. 3 keywords, the real-time detector's unflagged entity tokens);
- :class:`CtrlAQuery`: CtrlA's masked query (Eq. 3), :func:`detectors.ctrla.monitor.masked_query`.

:func:`detectors.rag.families.make_query` builds one by name (its :class:`QueryEntry` below) with its own settings
(``rag_eval.query_settings.<name>``, :mod:`detectors.config.queries`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from detectors.config.queries import DiorQueryParams, DiorWeightsParams, QfsParams
from detectors.errors import InputError
from detectors.llm.layers import attention_implementation
from detectors.llm.loading import LLM
from detectors.llm.words import DEFAULT_STOPWORDS, word_mask, word_spans
from detectors.sources.text import normalize_text


@dataclasses.dataclass
class QueryInput:
    """What a formulation reads: the question, the kept answer tokens and, after a token trigger fired at
    ``position``, the segment (None before generating)."""

    question: str
    kept: list[int]
    segment: Any = None  # SegmentView
    position: int = 0
    question_stats: dict[str, Any] = dataclasses.field(default_factory=dict)


def flare_query(tokenizer, question: str, gen_ids: list[int], probs: np.ndarray, theta: float) -> str:
    """The segment without the words that hold a token of probability below ``theta``; the question when no word is
    left (FLARE's first query is the input itself)."""
    kept = "".join(
        text for idx, text in word_spans(tokenizer, gen_ids) if min(float(probs[i]) for i in idx) >= theta
    ).strip()
    return kept or question.strip()


def last_layer_attention(llm: LLM, rows: list[list[int]]) -> list[np.ndarray]:
    """``[T, T]`` last-layer self-attention of each row of token ids, averaged over heads: one eager pass over the rows
    right-padded (causal attention keeps every real token from the padding after it), the model's attention
    implementation restored afterwards."""
    if not rows:
        return []
    width = max(len(r) for r in rows)
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=llm.device)
    with torch.no_grad(), attention_implementation(llm.model, "eager"):
        out = llm.model(ids, output_attentions=True, logits_to_keep=1)
    weights = out.attentions[-1].float().mean(1).cpu().numpy()
    return [weights[b, : len(r), : len(r)] for b, r in enumerate(rows)]


def qfs_query(
    llm: LLM,
    context_ids: list[int],
    position: int,
    top_n: int,
    stopwords: frozenset[str] = DEFAULT_STOPWORDS,
    attention: np.ndarray | None = None,
) -> str:
    """DRAGIN QFS: the ``top_n`` content tokens before ``position`` that the token at ``position`` attends to most,
    their words in text order (the whole context when nothing precedes it). ``attention``: the last-layer attention of
    ``context_ids[: position + 1]`` when the caller computed it (:func:`last_layer_attention`)."""
    tok = llm.tokenizer
    if position <= 0:
        return tok.decode(context_ids[: position + 1], skip_special_tokens=True).strip()
    if attention is None:
        (attention,) = last_layer_attention(llm, [context_ids[: position + 1]])
    row = attention[position, :position]
    before = context_ids[:position]
    content = np.asarray(word_mask(tok, before, stopwords), dtype=bool)
    ranked = [i for i in np.argsort(-row, kind="stable") if content[i]][:top_n]
    chosen = set(int(i) for i in ranked)
    words = [text.strip() for idx, text in word_spans(tok, before) if chosen & set(idx)]
    return " ".join(dict.fromkeys(w for w in words if w)) or tok.decode(before, skip_special_tokens=True).strip()


def _minmax(x: np.ndarray) -> np.ndarray:
    span = x.max() - x.min() if len(x) else 0.0
    return (x - x.min()) / span if span > 0 else np.zeros_like(x)


def importance_scores(
    llm: LLM,
    question: str,
    context_ids: list[int],
    candidates: list[str],
    weights: DiorWeightsParams,
    idf: Callable[[str], float],
    attention: np.ndarray | None = None,
) -> np.ndarray:
    """DioR's I_i for each candidate: ``w_a·A + w_t·TFIDF + w_p·P + w_s·S``, each term min-max normalised over the
    candidates. A: attention the candidate's tokens receive from later tokens (last layer, mean over heads and
    positions); TFIDF: its count among the context's words × ``idf``; P: Pos/N of its last occurrence; S: cosine
    similarity of its and the question's mean input embeddings. A candidate absent from the context has A = P = 0.
    ``attention``: the context's last-layer attention when the caller computed it (:func:`last_layer_attention`)."""
    tok = llm.tokenizer
    words = word_spans(tok, context_ids)
    norms = [normalize_text(text) for _, text in words]
    if len(context_ids) <= 1:
        attn = np.zeros((len(context_ids), len(context_ids)))
    else:
        attn = attention if attention is not None else last_layer_attention(llm, [context_ids])[0]
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


def dior_query(
    llm: LLM,
    question: str,
    context_ids: list[int],
    candidates: list[str],
    weights: DiorWeightsParams,
    idf: Callable[[str], float],
    top: int,
    attention: np.ndarray | None = None,
) -> str:
    """The question followed by the ``top`` candidates by DioR's importance score (ties: the candidates' order)."""
    candidates = list(dict.fromkeys(c.strip() for c in candidates if c.strip()))
    if not candidates:
        return question.strip()
    scores = importance_scores(llm, question, context_ids, candidates, weights, idf, attention)
    order = np.argsort(-scores, kind="stable")[:top]
    return f"{question.strip()} {' '.join(candidates[i] for i in order)}".strip()


# ---- the formulations the loop calls -----------------------------------------------------------------------


class _Formulation:
    """Formulates one query per :class:`QueryInput` (``formulate``); ``formulate_all`` does a batch of them (the loop
    calls it with every row that retrieves in a round), by default one after another."""

    # the index's term statistics it reads besides the hits (detectors.rag.retriever.TermStatistics: "idf")
    index_statistics: ClassVar[tuple[str, ...]] = ()

    def formulate(self, llm: LLM, q: QueryInput) -> str:
        raise NotImplementedError

    def formulate_all(self, llm: LLM, inputs: list[QueryInput]) -> list[str]:
        return [self.formulate(llm, q) for q in inputs]


class _Attending(_Formulation):
    """A formulation that reads the last-layer attention over the question and the answer up to the flagged token
    (QFS, DioR): a batch's attentions come from one eager pass."""

    def formulate(self, llm: LLM, q: QueryInput) -> str:
        return self.formulate_all(llm, [q])[0]

    def formulate_all(self, llm: LLM, inputs: list[QueryInput]) -> list[str]:
        contexts = [_answer_context(llm, q) for q in inputs]
        attending = [i for i, c in enumerate(contexts) if len(c) > 1]
        attention: list[np.ndarray | None] = [None] * len(inputs)
        for i, a in zip(attending, last_layer_attention(llm, [contexts[i] for i in attending])):
            attention[i] = a
        return [self._with_attention(llm, q, c, a) for q, c, a in zip(inputs, contexts, attention)]

    def _with_attention(self, llm: LLM, q: QueryInput, context: list[int], attention: np.ndarray | None) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class QuestionQuery(_Formulation):
    name: str = "question"
    needs: tuple[str, ...] = ()

    def formulate(self, llm: LLM, q: QueryInput) -> str:
        return q.question


@dataclasses.dataclass(frozen=True)
class FlareQuery(_Formulation):
    """FLARE's masked query; ``theta``: the probability under which a word is masked (1 - FLARE's threshold)."""

    theta: float = 0.5
    name: str = "flare"
    needs: tuple[str, ...] = ()

    def formulate(self, llm: LLM, q: QueryInput) -> str:
        if q.segment is None:
            return q.question
        return flare_query(llm.tokenizer, q.question, q.segment.gen_ids, q.segment.stats["prob"], self.theta)


def _answer_context(llm: LLM, q: QueryInput) -> list[int]:
    """The question and the answer up to the flagged token: what QFS and DioR's attention terms read."""
    generated = q.kept + (q.segment.gen_ids[: q.position + 1] if q.segment is not None else [])
    return llm.tokenizer(q.question, add_special_tokens=False)["input_ids"] + generated


@dataclasses.dataclass(frozen=True)
class QfsQuery(_Attending):
    top_n: int = 8
    stopwords: frozenset[str] = DEFAULT_STOPWORDS
    name: str = "qfs"
    needs: tuple[str, ...] = ()

    def _with_attention(self, llm: LLM, q: QueryInput, context: list[int], attention: np.ndarray | None) -> str:
        return qfs_query(llm, context, len(context) - 1, self.top_n, self.stopwords, attention)


@dataclasses.dataclass(frozen=True)
class DiorQuery(_Attending):
    """DioR's importance-scored query over the keyword candidates the triggers measured (``keywords`` of the
    question and of the segment), or the question's content words when no trigger measures any."""

    weights: DiorWeightsParams = DiorWeightsParams(0.25, 0.25, 0.25, 0.25)
    top: int = 5
    idf: Callable[[str], float] | None = None
    name: str = "dior"
    needs: tuple[str, ...] = ()
    index_statistics: ClassVar[tuple[str, ...]] = ("idf",)  # TF-IDF weighs the candidates by the index's idf

    def _idf(self) -> Callable[[str], float]:
        if self.idf is None:
            raise InputError(
                "query 'dior' weighs its keywords by the index's idf, and its retriever gives none: open the index "
                "with an engine that has term statistics (detectors.rag.retriever.TermStatistics), or use another query"
            )
        return self.idf

    def candidates(self, llm: LLM, q: QueryInput) -> list[str]:
        out = list(q.question_stats.get("keywords", []))
        if q.segment is not None:
            out += list(q.segment.stat("keywords", []))
        if not out:
            ids = llm.tokenizer(q.question, add_special_tokens=False)["input_ids"]
            mask = word_mask(llm.tokenizer, ids)
            out = llm.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True).split()
        return list(dict.fromkeys(w for w in out if w.strip()))

    def _with_attention(self, llm: LLM, q: QueryInput, context: list[int], attention: np.ndarray | None) -> str:
        return dior_query(
            llm,
            q.question,
            context,
            self.candidates(llm, q),
            self.weights,
            self._idf(),
            self.top,
            attention,
        )


@dataclasses.dataclass(frozen=True)
class CtrlAQuery(_Formulation):
    """CtrlA's Eq. 3: the question and the segment without its new, unconfident words (Eq. 2 < 0)."""

    name: str = "ctrla"
    needs: tuple[str, ...] = ("ctrla_eq2",)

    def formulate(self, llm: LLM, q: QueryInput) -> str:
        from detectors.ctrla.monitor import masked_query

        if q.segment is None:
            return q.question
        # y<t: the prompt's primer and passages are not
        preceding = llm.tokenizer.decode(q.segment.kept_ids, skip_special_tokens=True)
        return masked_query(llm.tokenizer, q.question, preceding, q.segment.gen_ids, q.segment.stats["ctrla_eq2"])


# ---- the entries, registered by name in detectors.extensions.QUERIES ------------------------------------------

Idf = Callable[[str], float] | None


@dataclasses.dataclass(frozen=True)
class QueryEntry:
    """One formulation as :data:`detectors.extensions.QUERIES` names it: ``build(settings, triggers, idf)`` makes it
    from its own settings (``rag_eval.query_settings.<name>``, of the type ``settings`` declares; None: it takes
    none), the configuration's triggers (its siblings in the loop; it reads what it needs of them) and the retriever's
    idf (None without a retriever)."""

    build: Callable[[Any, Sequence[Any], Idf], _Formulation]
    settings: type | None = None


def _required(name: str, settings: Any, example: str) -> Any:
    if settings is None:
        raise InputError(f"query {name!r} reads rag_eval.query_settings.{name}: give its settings, e.g. {example}")
    return settings


def _flare(settings: None, triggers: Sequence[Any], idf: Idf) -> FlareQuery:
    """Words are masked under 1 - the threshold of the configuration's FLARE trigger (the trigger built by the
    ``flare`` entry; 0.5 without one)."""
    threshold = next((t.threshold for t in triggers if t.entry == "flare"), None)
    return FlareQuery(0.5 if threshold is None else 1 - threshold)


def _qfs(settings: QfsParams | None, triggers: Sequence[Any], idf: Idf) -> QfsQuery:
    return QfsQuery(_required("qfs", settings, "{top_n: 8}").top_n)


def _dior(settings: DiorQueryParams | None, triggers: Sequence[Any], idf: Idf) -> DiorQuery:
    own = _required("dior", settings, "{top: 5, weights: {attention: 0.25, tfidf: 0.25, position: 0.25, ...}}")
    return DiorQuery(own.weights, own.top, idf)


QUESTION = QueryEntry(lambda settings, triggers, idf: QuestionQuery())
FLARE = QueryEntry(_flare)
QFS = QueryEntry(_qfs, QfsParams)
DIOR = QueryEntry(_dior, DiorQueryParams)
CTRLA = QueryEntry(lambda settings, triggers, idf: CtrlAQuery())
