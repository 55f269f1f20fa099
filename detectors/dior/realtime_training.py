"""Training the real-time detector: one MLP per candidate token set (entity tokens, or every generated token),
kept by the validation continuation AUROC of what is served, the max of its probability over all generated
tokens (:func:`detectors.dior.served.served_auroc`)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd
import torch

from detectors.config.schema import RealtimePromptParams, TrainingParams
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector, collate, token_table
from detectors.dior.served import served_auroc, served_threshold
from detectors.evaluation.metrics import OneClassError, choose_threshold, require_both_classes
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.layers import hidden_state_indices
from detectors.registry.artifact import frame_dtype
from detectors.training import fit, training_info

log = logging.getLogger(__name__)


def train_realtime_detector(
    frame: pd.DataFrame,
    hidden: np.ndarray,
    params: TrainingParams,
    *,
    tokens: str = "entity",
    hidden_layers: list[int],
    prompt: RealtimePromptParams,
    spacy_model: str,
    fingerprint: Fingerprint,
    llm_ref: dict[str, Any],
    fast_dev_run: bool = False,
) -> RealtimeDetector:
    """Train on the ``tokens`` (``entity`` or ``all``, see :func:`token_table`) of ``train``; early-stop and choose
    the threshold on the same tokens of ``val`` only.

    ``hidden_layers``, ``prompt`` and ``spacy_model`` are how the set was recorded: the detector stores
    them (and the layers' hidden-state indices for ``fingerprint``'s depth) so that serving captures the
    same features, and the dtype they were computed in (the set's ``feature_dtype`` column) in ``llm_ref``.
    """
    llm_ref = {**llm_ref, "dtype": frame_dtype(frame, "the real-time set")}
    x, y, where = token_table(frame, hidden, tokens)
    train, val = (where["split"] == "train").to_numpy(), (where["split"] == "val").to_numpy()
    require_both_classes(y[train], f"the train split's {tokens} tokens")
    require_both_classes(y[val], f"the validation split's {tokens} tokens")
    mean, std = x[train].mean(0), x[train].std(0) + 1e-4
    z = torch.from_numpy(((x - mean) / std).astype(np.float32))
    items = [{"x": z[i], "label": int(y[i])} for i in range(len(y))]
    net, summary = fit(
        lambda: TokenMLP(x.shape[1], params.hidden, params.dropout),
        [items[i] for i in np.flatnonzero(train)],
        [items[i] for i in np.flatnonzero(val)],
        collate,
        params,
        fast_dev_run=fast_dev_run,
    )
    detector = RealtimeDetector(
        net, mean, std, 0.5, list(hidden_layers),
        hidden_state_indices(hidden_layers, fingerprint.num_layers, "build_realtime.hidden_layers"),
        prompt, spacy_model, fingerprint, llm_ref, {},
    )  # fmt: skip
    detector.threshold = choose_threshold(y[val], detector.predict_proba(x[val]), params.threshold)
    detector.info = training_info(
        summary, params, tokens=tokens, n_train_tokens=int(train.sum()), n_val_tokens=int(val.sum()),
        train_hallucination_rate=float(y[train].mean()),
    )  # fmt: skip
    return detector


def train_and_choose(
    frame: pd.DataFrame, hidden: np.ndarray, params: TrainingParams, candidates: list[str], **kwargs
) -> RealtimeDetector:
    """Train one detector per token set in ``candidates`` (``train_realtime.tokens``) and keep the one whose served
    score (max over all generated tokens) has the best continuation AUROC on validation; the first listed wins a tie.

    The kept detector's ``info`` records the choice (``tokens``), its ``val_served_auroc`` and every candidate's
    (``candidates``). Its ``threshold`` is then chosen for serving: on the validation continuations' max over all
    generated tokens (the token-level one stays in ``info["token_threshold"]``), because served it fires at the
    first token that reaches it; a token-level threshold fires on most correct continuations. With one candidate a
    one-class validation split leaves its served AUROC None (and the token-level threshold); with more, it is an
    error (nothing to choose by).
    """
    val = frame[frame["split"] == "val"]
    best, best_auroc, best_scores, summary = None, float("-inf"), {}, {}
    for tokens in candidates:
        detector = train_realtime_detector(frame, hidden, params, tokens=tokens, **kwargs)
        val_scores = detector.record_scores(val, hidden)
        try:
            value = served_auroc(val, val_scores, "val")
        except OneClassError as err:
            if len(candidates) > 1:
                raise OneClassError(f"train_realtime.tokens = {candidates}: cannot choose a candidate by validation ({err})") from err
            value = None
        info = detector.info
        summary[tokens] = {"val_served_auroc": value, "best_val_auroc": info["best_val_auroc"], "threshold": detector.threshold}
        log.info("trained on %s tokens: validation served continuation AUROC %s", tokens, value)
        if best is None or (value is not None and value > best_auroc):
            best, best_auroc, best_scores = detector, value, val_scores
    best.info = {**best.info, "val_served_auroc": summary[best.info["tokens"]]["val_served_auroc"], "candidates": summary}
    if best_auroc is not None:  # serving fires when the max so far reaches the threshold
        token_threshold = best.threshold
        best.threshold = served_threshold(val, best_scores, params.threshold)
        best.info |= {"token_threshold": token_threshold, "threshold_chosen_on": "validation continuations (max over tokens)"}
        log.info("served threshold %.4f (token-level %.4f)", best.threshold, token_threshold)
    return best
