"""Early-detection features of questions (DioR §3.1.1): one function shared by build_early and serving.

Questions are processed in batches: the prompt before them runs once, their tokens run as one
right-padded batch (causal attention keeps real positions from seeing the padding), IG runs over all
their interpolation steps together (:func:`detectors.dior.attribution.batch_token_attributions`) and
their greedy answers are decoded together by the shared decoder (:mod:`detectors.llm.decoder`, the RAG loop's). One
question is a batch of one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from detectors.config.schema import EarlyFeatureParams
from detectors.dior.attribution import (
    IGItem,
    attribution_distribution,
    attribution_entropy,
    batch_token_attributions,
    keyword_candidates,
)
from detectors.errors import RecordError
from detectors.llm.decoder import Decoder, Row
from detectors.llm.distribution import entropy
from detectors.llm.kv import KV, as_cache, prefix_kv, shared_prefix_length
from detectors.llm.layers import StateTap, hidden_state_indices
from detectors.llm.loading import LLM
from detectors.llm.offsets import token_offsets
from detectors.sources.text import contains_reference


@dataclasses.dataclass
class Continuation:
    """What a batch of prompts leaves to continue from: each row's prompt ids (prefix included), its key/value states
    (views of the batch's right-padded cache: a row's real positions never saw the padding) and its next-token logits
    (float32)."""

    ids: list[list[int]]
    kv: list[KV]
    logits: torch.Tensor  # [rows, vocab]


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
    cache: Continuation  # what the batch's prompts leave (shared by the batch), to continue generation from
    row: int = 0  # this question's row in ``cache``


def _encode(llm: LLM, question: str, params: EarlyFeatureParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's ids ``[L]`` and question mask ``[L]``, or a RecordError saying why the question is unusable."""
    if not question or not question.strip():
        raise RecordError("empty question")
    ids, mask = llm.encode_prompt(question, params.prompt)
    n_question = int(mask.sum())
    if n_question == 0:
        raise RecordError("the question has no tokens after tokenisation")
    if n_question > params.max_question_tokens:
        raise RecordError(f"question has {n_question} tokens > max_question_tokens={params.max_question_tokens}")
    max_len = getattr(llm.model.config, "max_position_embeddings", None)
    if max_len is not None and ids.shape[1] >= max_len:
        raise RecordError(f"prompt has {ids.shape[1]} tokens, the LLM's context is {max_len}")
    return ids[0], mask


def batch_question_features(
    llm: LLM, questions: list[str], params: EarlyFeatureParams, attribution: bool = True
) -> list[QuestionFeatures | RecordError]:
    """Features of each question before any answer token is generated, or the RecordError that makes it unusable.
    Without ``attribution`` IG is not run (most of the cost): the attribution is empty, its entropy nan and there are
    no keywords, for a reader of the logit and hidden-state features only."""
    layers = hidden_state_indices(
        params.hidden_layers, llm.fingerprint.num_layers, "build_early.features.hidden_layers"
    )
    out: dict[int, QuestionFeatures | RecordError] = {}
    encoded = {}
    for i, question in enumerate(questions):
        try:
            encoded[i] = _encode(llm, question, params)
        except RecordError as err:
            out[i] = err
    if not encoded:
        return [out[i] for i in range(len(questions))]
    keys = list(encoded)
    ids = [encoded[i][0].tolist() for i in keys]
    starts = [int(encoded[i][1].nonzero()[0, 0]) for i in keys]
    common = min(shared_prefix_length(ids), *starts)
    # one pass over the shared prompt prefix (cached for IG and the answers), one over the rest of every prompt
    prefix = prefix_kv(llm.model, torch.tensor([ids[0][:common]], device=llm.device), common)
    rows = [r[common:] for r in ids]
    width = max(len(r) for r in rows)
    pad = llm.tokenizer.pad_token_id or 0
    batch = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=llm.device)
    with torch.no_grad():
        res = llm.model(
            batch,
            past_key_values=as_cache(prefix, len(rows), llm.model.config),
            output_hidden_states=True,
            use_cache=True,
        )
    last = torch.tensor([len(r) - 1 for r in rows], device=llm.device)
    at = torch.arange(len(rows), device=llm.device)
    logits = res.logits[at, last].float()
    logp = torch.log_softmax(logits, dim=-1)
    top2 = torch.topk(logp.exp(), 2, dim=-1)
    first_entropy = entropy(logp)
    hidden = torch.cat([res.hidden_states[layer][at, last].float() for layer in layers], dim=-1).cpu().numpy()
    cache = res.past_key_values.layers
    continuation = Continuation(
        ids,
        [
            [(c.keys[b : b + 1, :, : common + len(r)], c.values[b : b + 1, :, : common + len(r)]) for c in cache]
            for b, r in enumerate(rows)
        ],
        logits,
    )
    items = [
        IGItem(encoded[i][0][common:], encoded[i][1][common:], int(top2.indices[b, 0])) for b, i in enumerate(keys)
    ]
    if attribution:
        scores = batch_token_attributions(llm.model, items, params.n_steps, params.method, params.ig_batch_size, prefix)
    for b, i in enumerate(keys):
        p = attribution_distribution(scores[b]) if attribution else np.zeros(0)
        q_ids, q_mask = encoded[i]
        q = q_ids[q_mask].tolist()
        tokens = [llm.tokenizer.decode([t]) for t in q]
        text = llm.tokenizer.decode(q, skip_special_tokens=True)
        keywords = keyword_candidates(text, token_offsets(llm, q), p) if attribution else []
        out[i] = QuestionFeatures(
            question_tokens=tokens,
            attribution=p.astype(np.float32),
            entropy=attribution_entropy(p) if attribution else float("nan"),
            keywords=keywords,
            first_token_id=int(top2.indices[b, 0]),
            first_token_prob=float(top2.values[b, 0]),
            first_token_entropy=float(first_entropy[b]),
            first_token_margin=float(top2.values[b, 0] - top2.values[b, 1]),
            hidden=hidden[b].astype(np.float32),
            cache=continuation,
            row=b,
        )
    return [out[i] for i in range(len(questions))]


def question_features(llm: LLM, question: str, params: EarlyFeatureParams) -> QuestionFeatures:
    """Features of one question (a batch of one); raises RecordError when it is unusable."""
    (f,) = batch_question_features(llm, [question], params)
    if isinstance(f, RecordError):
        raise f
    return f


@dataclasses.dataclass
class Answer:
    """A question's greedy answer and what the LLM did while decoding it, token by token, as the RAG loop sees a
    segment: ``ids`` are the answer's tokens without the one that completes a stop string (the text is what comes
    before the stop string), each with the probability it had when chosen and that distribution's entropy, and,
    when layers were asked for and it has tokens, their hidden states at their own positions (as the real-time
    detector reads them)."""

    text: str
    ids: list[int]
    prob: np.ndarray  # [n]
    entropy: np.ndarray  # [n] nats
    hidden: np.ndarray | None  # [n, len(layers) * H] float16; None without layers or tokens


def decode_answers(
    llm: LLM,
    feats: list[QuestionFeatures],
    max_new_tokens: int,
    stop: list[str] = (),
    state_indices: list[int] | None = None,
) -> list[Answer]:
    """Each question's greedy continuation up to the first stop string or end of sequence, decoded together by the
    shared decoder (:class:`~detectors.llm.decoder.Decoder`, the RAG loop's).

    Continues from the prompts' states and logits (``feats`` from one :func:`batch_question_features` call), so no
    prompt runs again. With ``state_indices`` (hidden-state indices, see :mod:`detectors.llm.layers`) every kept token
    is run (the last one too) and its hidden states at those indices are captured on the way.
    """
    if not feats:
        return []
    cont = feats[0].cache
    if any(f.cache is not cont for f in feats):
        raise ValueError("decode_answers continues one batch: pass features from one batch_question_features call")
    probes = {"states": StateTap(llm.model, state_indices)} if state_indices else {}
    decoder = Decoder(llm, max_new_tokens, stop, probes)
    rows = [Row(ran=list(cont.ids[f.row]), kv=cont.kv[f.row], logits=cont.logits[f.row]) for f in feats]
    decoder.decode(rows)
    answers = []
    for row in rows:
        said = row.gen + ([row.stop_token] if row.stop_token is not None else [])  # the text is cut at the stop
        hidden = None
        if state_indices and row.gen:  # a token kept is a token run
            hidden = torch.cat(row.values["states"])[: len(row.gen)].cpu().numpy()
        answers.append(
            Answer(
                decoder.final_text(said),
                list(row.gen),
                np.array(row.prob, np.float32),
                np.array(row.entropy, np.float32),
                hidden,
            )
        )
    return answers


def greedy_answers(llm: LLM, feats: list[QuestionFeatures], max_new_tokens: int, stop: list[str] = ()) -> list[str]:
    """Each question's greedy answer (the text of :func:`decode_answers`)."""
    return [a.text for a in decode_answers(llm, feats, max_new_tokens, stop)]


def greedy_answer(llm: LLM, f: QuestionFeatures, max_new_tokens: int, stop: list[str] = ()) -> str:
    """One question's greedy answer (see :func:`greedy_answers`)."""
    return greedy_answers(llm, [f], max_new_tokens, stop)[0]


def early_records(
    llm: LLM,
    questions: list[str],
    answers: list[list[str]],
    features: EarlyFeatureParams,
    max_new_tokens: int,
    stop: list[str],
    state_indices: list[int] | None = None,
) -> list[dict | RecordError]:
    """Rows of the early-detection set for a batch of questions: features, greedy answer and the containment
    label (1 = hallucination: no reference answer contained in the answer), or the RecordError of an unusable one.

    Each row also has its answer's tokens (``answer_ids``) with their probability and entropy; with
    ``state_indices`` also ``answer_hidden``, their hidden states (:class:`Answer`; none for an answer without
    tokens), which a caller storing the row in a table keeps elsewhere: the real-time detector's candidate training
    set of QA answers."""
    feats = batch_question_features(llm, questions, features)
    usable = [f for f in feats if isinstance(f, QuestionFeatures)]
    said = iter(decode_answers(llm, usable, max_new_tokens, stop, state_indices))
    out: list[dict | RecordError] = []
    for f, refs in zip(feats, answers):
        if isinstance(f, RecordError):
            out.append(f)
            continue
        answer = next(said)
        row = {
            "answer": answer.text,
            "label": int(not contains_reference(answer.text, refs)),
            **features_to_row(f),
            "answer_ids": answer.ids,
            "answer_prob": answer.prob.tolist(),
            "answer_entropy": answer.entropy.tolist(),
        }
        if answer.hidden is not None:
            row["answer_hidden"] = answer.hidden
        out.append(row)
    return out


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
