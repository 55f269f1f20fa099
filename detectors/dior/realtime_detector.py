"""The trained real-time detector: its training table, its artifact, and serving (training is in
:mod:`detectors.dior.realtime_training`, the served view's metrics in :mod:`detectors.dior.served`).

The artifact is a directory: ``weights.safetensors`` and ``detector.json`` (network shape,
standardisation, validation threshold, capture layers, prompt, spaCy model, LLM fingerprint and the
dtype the features were computed in).
Serving scores tokens with the same ``GenerationRecorder`` and ``token_features`` as build_realtime.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import StoppingCriteria

from detectors.config.schema import RealtimePromptParams
from detectors.dior.nets import TokenMLP
from detectors.dior.recorder import (
    GenerationRecorder,
    TokenTrace,
    eos_ids,
    feature_rows,
    generate_traced,
    render_prompt,
    token_features,
)
from detectors.ensemble import per_seed
from detectors.evaluation.metrics import first_hit
from detectors.interfaces import Detector, Registration, Watch
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.loading import LLM
from detectors.llm.offsets import token_offsets, words_and_tokens
from detectors.registry.artifact import DeclaredArtifact, FrameInputs


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([it["x"] for it in items]), "label": torch.tensor([it["label"] for it in items])}


TOKENS = ("entity", "all")  # what a detector trains on: entity tokens, or every generated token
CONTINUATIONS, ANSWERS = "continuations", "answers"  # the record sets a detector is trained and judged on


def token_table(
    frame: pd.DataFrame, hidden: np.ndarray, tokens: str = "entity"
) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """Features and labels of the ok records' ``tokens`` and where each came from: ``entity``, the entity tokens
    (labelled by their entity); ``all``, every generated token (a token outside any entity labelled 0, supported)."""
    if tokens not in TOKENS:
        raise ValueError(f"tokens = {tokens!r}: use one of {list(TOKENS)}")
    feats, labels, where = [], [], []
    for row in frame[frame["status"] == "ok"].itertuples():
        token_label = np.asarray(row.token_label)
        idx = np.flatnonzero(token_label >= 0) if tokens == "entity" else np.arange(len(token_label))
        if not len(idx):
            continue
        h = hidden[row.hidden_offset + idx]
        feats.append(token_features(h, np.asarray(row.prob)[idx], np.asarray(row.entropy)[idx]))
        labels.append(np.maximum(token_label[idx], 0))
        where.append(pd.DataFrame({"record": row.id, "split": row.split, "token": idx}))
    width = hidden.shape[1] + 3
    if not feats:
        return (
            np.zeros((0, width), np.float32),
            np.zeros(0, np.int64),
            pd.DataFrame(columns=["record", "split", "token"]),
        )
    return np.concatenate(feats), np.concatenate(labels).astype(np.int64), pd.concat(where, ignore_index=True)


def answer_records(early: pd.DataFrame) -> pd.DataFrame:
    """The early set's answers as records of the real-time set's schema (what :func:`token_table`, ``record_scores``
    and :mod:`detectors.dior.served` read): every ok question whose answer has a token, its tokens (``gen_ids``,
    ``prob``, ``entropy``, hidden-state rows from ``answer_hidden_offset``) all labelled with the answer's label."""
    ok = early[(early["status"] == "ok") & (early["answer_ids"].map(len) > 0)]
    return pd.DataFrame(
        {
            "id": ok["id"],
            "split": ok["split"],
            "status": "ok",
            "label": ok["label"].astype(int),
            "feature_dtype": ok["feature_dtype"],
            "gen_ids": ok["answer_ids"],
            "prob": ok["answer_prob"],
            "entropy": ok["answer_entropy"],
            "token_label": [[int(label)] * len(ids) for label, ids in zip(ok["label"], ok["answer_ids"])],
            "hidden_offset": ok["answer_hidden_offset"],
        }
    ).reset_index(drop=True)


class TriggerStop(StoppingCriteria):
    """Stops ``model.generate`` once every sequence has a token at or above the detector's threshold (on the
    scores' device: only the tokens scored since the last call are compared)."""

    def __init__(self, recorder: GenerationRecorder, threshold: float):
        self.recorder, self.threshold = recorder, threshold
        self._scores: list | None = None  # the recorder's list last seen (a new one after ``with recorder:``)
        self._seen, self._hit = 0, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.recorder.scores is not self._scores:
            self._scores, self._seen = self.recorder.scores, 0
            self._hit = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for s in self._scores[self._seen :]:
            self._hit = self._hit | (torch.as_tensor(s).reshape(-1) >= self.threshold).to(input_ids.device)
        self._seen = len(self._scores)
        return self._hit


@dataclasses.dataclass
class RealtimeResult:
    """One continuation scored token by token (DioR Definition 2)."""

    text: str
    tokens: list[str]
    probabilities: list[float]  # P(hallucination) of each generated token
    trigger: int | None  # first token at or above the threshold: where retrieval should happen
    keywords: list[str]  # entity tokens of the text not flagged as hallucinated (DioR §3.2)


@dataclasses.dataclass
class RealtimeDetector(DeclaredArtifact, Detector):
    """The MLP over a generated token's hidden states, probability and entropy: retrieve at this token?"""

    KIND = "dior-realtime"
    DECIDES = "generation"
    TRIGGER = "realtime"
    WATCH_NEEDS = {"title": "continues the opening of a Wikipedia article (DioR's prompt)"}
    INPUTS = FrameInputs({"title": "string", "text": "string"})
    RENAMED = {"state_indices": "positions"}  # as artifacts written before the rename stored it

    net: TokenMLP
    mean: np.ndarray
    std: np.ndarray
    threshold: float
    hidden_layers: list[int]  # as named in params (1..L or negative)
    state_indices: list[int]  # their hidden_states indices for this LLM (see detectors.llm.layers)
    prompt: RealtimePromptParams
    spacy_model: str
    fingerprint: Fingerprint
    # where the training LLM came from and its feature dtype: {"dir", "source", "gguf_file", "dtype"}
    llm_ref: dict[str, Any]
    info: dict[str, Any]
    llm: LLM | None = None
    _nlp: Any = None
    _scoring: tuple | None = dataclasses.field(default=None, repr=False)  # (net, device, its copy there, mean, std)

    def per_seed(self) -> list[RealtimeDetector]:
        """The detector once per seed of its seed ensemble (none when trained with one seed)."""
        return per_seed(self)

    def registration(self) -> Registration:
        """Compared by its served validation AUROC (the max over a record's tokens; its token AUROC is over the token
        set it was trained on, so not comparable across versions), with a version of the same layers chosen on the
        same records (an older champion compared on another number waits as challenger)."""
        layers, chosen_on = ",".join(map(str, self.hidden_layers)), self.info.get("chosen_on", CONTINUATIONS)
        return Registration(
            f"hidden layers {layers}; served validation AUROC on the {chosen_on}",
            {"hidden_layers": layers, "chosen_on": chosen_on},
            "val_served_auroc",
        )

    # ---- scoring --------------------------------------------------------------------------------
    def predict_proba(self, features: np.ndarray, batch_size: int = 4096) -> np.ndarray:
        """P(hallucination) for rows of ``token_features`` (the stored sets), on the CPU: the computation
        :meth:`score_tokens` runs on each generated token (:meth:`_probabilities`)."""
        rows = torch.from_numpy(np.require(features, np.float32, "C"))
        scoring = self._scoring_parts(torch.device("cpu"))  # made afresh: the net may have been trained since
        parts = [self._probabilities(*scoring, rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
        return torch.cat(parts).reshape(-1).numpy() if parts else np.zeros(0, np.float32)

    def record_scores(self, frame: pd.DataFrame, hidden: np.ndarray) -> dict[str, np.ndarray]:
        """P(hallucination) of every generated token of the set's ok records from the stored features, entity
        tokens or not: what ``monitor`` computes for each token while the LLM generates."""
        x, _, where = token_table(frame, hidden, "all")
        probs = self.predict_proba(x) if len(x) else np.zeros(0)
        out = {row.id: np.full(len(row.gen_ids), np.nan) for row in frame[frame["status"] == "ok"].itertuples()}
        for (record, token), p in zip(where[["record", "token"]].itertuples(index=False), probs):
            out[record][token] = p
        return out

    def score_tokens(self, hidden: torch.Tensor, prob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """The recorder's scorer: one batch of freshly generated tokens, scored on their device while generation runs
        (no host copy): :meth:`predict_proba` of ``token_features(hidden, prob, entropy)``, computed there."""
        if self._scoring is None or self._scoring[0] is not self.net or self._scoring[1] != hidden.device:
            self._scoring = (self.net, hidden.device, *self._scoring_parts(hidden.device))
        return self._probabilities(*self._scoring[2:], feature_rows(hidden, prob, entropy))

    def _scoring_parts(self, device: torch.device) -> tuple[TokenMLP, torch.Tensor, torch.Tensor]:
        """A copy of the net in eval mode, the mean and the std, on ``device``."""
        net = copy.deepcopy(self.net).to(device).eval().requires_grad_(False)
        mean, std = (torch.from_numpy(np.asarray(a, np.float32)).to(device) for a in (self.mean, self.std))
        return net, mean, std

    @staticmethod
    def _probabilities(net: TokenMLP, mean: torch.Tensor, std: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """P(hallucination) of MLP input rows (:func:`~detectors.dior.recorder.feature_rows`): the one computation,
        offline and online."""
        with torch.no_grad():
            return torch.sigmoid(net({"x": (rows - mean) / std}))

    def monitor(self, llm: LLM | None = None) -> GenerationRecorder:
        """A recorder that scores every generated token of ``model.generate``::

        with det.monitor() as mon:
            model.generate(**enc, logits_processor=[mon], stopping_criteria=[det.stop_on_trigger(mon)])
        result = det.result(mon)
        """
        if llm is not None and llm is not self.llm:
            self.attach(llm)
        return GenerationRecorder(self.require_llm().model, self.state_indices, self.score_tokens)

    def stop_on_trigger(self, recorder: GenerationRecorder) -> TriggerStop:
        return TriggerStop(recorder, self.threshold)

    def first_trigger(self, probabilities) -> int | None:
        return first_hit(np.asarray(probabilities) >= self.threshold)

    def keywords(self, gen_ids: list[int], probabilities) -> list[str]:
        """DioR §3.2: the whole words of the generated text's entities whose tokens are none flagged as hallucinated
        (each once, in text order). Words, not tokens decoded one by one: a name whose UTF-8 bytes span tokens would
        come out as replacement characters and fragments (:func:`~detectors.llm.offsets.words_and_tokens`)."""
        if self._nlp is None:
            import spacy

            self._nlp = spacy.load(self.spacy_model)
        text = self.llm.tokenizer.decode(gen_ids, skip_special_tokens=True)
        offsets = token_offsets(self.llm, gen_ids)
        out: dict[str, None] = {}
        for ent in self._nlp(text).ents:
            for word, tokens in words_and_tokens(text, offsets, ent.start_char, ent.end_char):
                if tokens and all(probabilities[i] < self.threshold for i in tokens):
                    out.setdefault(word)
        return list(out)

    def result(self, recorder: GenerationRecorder, row: int = 0) -> RealtimeResult:
        """What ``recorder`` saw of batch row ``row``: per-token probabilities, trigger and keywords."""
        return self._result(recorder.traces(eos_ids(self.llm))[row])

    def generate(self, title: str, text: str, max_new_tokens: int = 32) -> RealtimeResult:
        """Continue ``text`` with the training prompt and score every token (a convenience for the
        common case; RAG loops with their own prompts use ``monitor``)."""
        prompt = render_prompt(self.require_llm(), title, text, self.prompt)
        _, traces = generate_traced(
            self.llm, [prompt], self.state_indices, max_new_tokens, self.prompt.chat, self.score_tokens
        )
        return self._result(traces[0])

    def watch(self, text: str, max_new_tokens: int | None = None, **needs: Any) -> Watch:
        """:meth:`generate` continuing the article ``needs["title"]`` from ``text``, as a :class:`Watch`."""
        r = self.generate(needs["title"], text, max_new_tokens or 32)
        rule = f"P(hallucination) >= {self.threshold:.3f}"
        return Watch(r.tokens, r.probabilities, r.trigger, rule, {"keywords": r.keywords})

    def _result(self, trace: TokenTrace) -> RealtimeResult:
        probs = trace.scores.tolist() if trace.scores is not None else []
        return RealtimeResult(
            text=self.llm.tokenizer.decode(trace.gen_ids, skip_special_tokens=True),
            tokens=[self.llm.tokenizer.decode([t]) for t in trace.gen_ids],
            probabilities=probs,
            trigger=self.first_trigger(probs),
            keywords=self.keywords(trace.gen_ids, probs),
        )

    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        """pyfunc view: ``title`` and ``text`` columns in; continuation, per-token probabilities, trigger, keywords
        out."""
        results = [self.generate(str(r["title"]), str(r["text"])) for r in frame.to_dict("records")]
        return pd.DataFrame([dataclasses.asdict(r) for r in results])
