"""Training the real-time detector: one MLP (a seed ensemble, :mod:`detectors.ensemble`) per candidate training set
(the Wikipedia continuations' entity tokens or all their tokens, the QA answers' tokens, or several of them), and the
rule that keeps one: the default candidate (``train_realtime.default``) unless another beats it by a paired 95 %
bootstrap interval above 0 (:mod:`detectors.evaluation.choice`) on the AUROC of what is served, the max of its
probability over all of a record's tokens (:func:`detectors.dior.served.served_auroc`), on the validation records of
the continuations or of the QA answers (``choose_on``).

The records a candidate is judged on are never the ones it early-stops on: for the set chosen on, a fold of its
*train* records (``stop_share`` of them, by id hash: :func:`stop_fold`) early-stops the candidates instead of training
them, and its validation records only judge; the other set early-stops on its validation records as before.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pandas as pd
import torch

from detectors.config.schema import RealtimePromptParams, TrainingParams
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import ANSWERS, CONTINUATIONS, RealtimeDetector, collate, token_table
from detectors.dior.served import continuation_maxima, served_auroc, served_threshold
from detectors.errors import InputError
from detectors.evaluation.choice import auroc_deltas, choose, family_level, scored_units
from detectors.evaluation.metrics import OneClassError, choose_threshold, require_both_classes
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.layers import hidden_state_indices
from detectors.registry.artifact import frame_dtype
from detectors.registry.store import validation_digest
from detectors.sources.ids import in_fold, ok_records
from detectors.training import fit, training_info

log = logging.getLogger(__name__)

STOP_FOLD = "early-stopping"  # the salt of the fold of train records that early-stops instead of training


def stop_fold(where: pd.DataFrame, share: float) -> np.ndarray:
    """The splits of a set judged on, as its candidates use them: its validation records (``judge``) are left out of
    training and early stopping; a ``share`` of its train records (by id hash) early-stops (``val``); the rest trains.
    ``where``: :func:`token_table`'s rows (``record``, ``split``)."""
    fold = where["record"].map(lambda i: in_fold(str(i), share, STOP_FOLD)).to_numpy(bool)
    split = where["split"].to_numpy(object).copy()
    split[split == "val"] = "judge"
    split[(split == "train") & fold] = "val"
    return split


@dataclasses.dataclass(frozen=True)
class TokenSets:
    """What the real-time detector can learn from: ``continuations``, the real-time set's records and hidden-state
    rows; ``answers``, the early set's answers as records of the same schema
    (:func:`~detectors.dior.realtime_detector.answer_records`) and theirs, captured at the same layers."""

    continuations: tuple[pd.DataFrame, np.ndarray]
    answers: tuple[pd.DataFrame, np.ndarray] | None = None
    judged_on: str | None = None  # the set whose validation records judge the candidates (see :func:`stop_fold`)
    stop_share: float = 0.2  # the share of its train records that early-stops instead

    def __post_init__(self) -> None:
        if self.answers is None:
            return
        (cont, h_cont), (ans, h_ans) = self.continuations, self.answers
        if h_cont.shape[1] != h_ans.shape[1]:
            raise InputError(
                f"the QA answers' hidden states have width {h_ans.shape[1]}, the continuations' {h_cont.shape[1]}: "
                f"capture both at the "
                "same layers (build_early.answer_hidden_layers = build_realtime.hidden_layers) and rerun build_early"
            )
        if frame_dtype(cont, "the real-time set") != frame_dtype(ans, "the early set's answers"):
            raise InputError(
                "the real-time set and the early set were computed in different dtypes: rebuild one of them (llm.dtype)"
            )

    def records(self, source: str) -> tuple[pd.DataFrame, np.ndarray]:
        if source == CONTINUATIONS:
            return self.continuations
        if source != ANSWERS:
            raise ValueError(f"source = {source!r}: use {CONTINUATIONS!r} or {ANSWERS!r}")
        if self.answers is None:
            raise InputError(
                "no QA answer tokens were given: the 'answers' candidate and choose_on: answers need "
                "build_early's answer tokens"
            )
        return self.answers

    @property
    def sources(self) -> list[str]:
        return [CONTINUATIONS] + ([ANSWERS] if self.answers is not None else [])

    def table(self, candidate: str) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
        """:func:`token_table` of a candidate: ``entity`` or ``all`` of the continuations, ``answers`` (every answer
        token), or several joined by ``+``, stacked; the rows of the set ``judged_on`` with the splits of
        :func:`stop_fold`."""
        parts = []
        for part in candidate.split("+"):
            source = ANSWERS if part == ANSWERS else CONTINUATIONS
            x, y, where = token_table(*self.records(source), "all" if part == ANSWERS else part)
            if source == self.judged_on:
                where = where.assign(split=stop_fold(where, self.stop_share))
            parts.append((x, y, where))
        if len(parts) == 1:
            return parts[0]
        return (
            np.concatenate([x for x, _, _ in parts]),
            np.concatenate([y for _, y, _ in parts]),
            pd.concat([w for _, _, w in parts], ignore_index=True),
        )


def train_realtime_detector(
    sets: TokenSets,
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
    """Train on the ``tokens`` (a candidate of :meth:`TokenSets.table`) of ``train`` with ``params.seeds`` seeds;
    early-stop and choose the token-level threshold on the same tokens of ``val`` only (for the set the candidates are
    judged on, a fold of its train records: :func:`stop_fold`).

    ``hidden_layers``, ``prompt`` and ``spacy_model`` are how the set was recorded: the detector stores
    them (and the layers' hidden-state indices for ``fingerprint``'s depth) so that serving captures the
    same features, and the dtype they were computed in (the sets' ``feature_dtype`` column) in ``llm_ref``.
    """
    llm_ref = {**llm_ref, "dtype": frame_dtype(sets.continuations[0], "the real-time set")}
    x, y, where = sets.table(tokens)
    train, val = (where["split"] == "train").to_numpy(), (where["split"] == "val").to_numpy()
    require_both_classes(y[train], f"the train split's {tokens} tokens")
    require_both_classes(y[val], f"the early-stopping {tokens} tokens (validation split, or a fold of train)")
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
        net,
        mean,
        std,
        0.5,
        list(hidden_layers),
        hidden_state_indices(hidden_layers, fingerprint.num_layers, "build_realtime.hidden_layers"),
        prompt,
        spacy_model,
        fingerprint,
        llm_ref,
        {},
    )
    detector.threshold = choose_threshold(y[val], detector.predict_proba(x[val]), params.threshold)
    detector.info = training_info(
        summary,
        params,
        tokens=tokens,
        n_train_tokens=int(train.sum()),
        n_val_tokens=int(val.sum()),
        train_hallucination_rate=float(y[train].mean()),
    )
    return detector


def _served(detector: RealtimeDetector, sets: TokenSets, source: str, split: str) -> tuple[float | None, dict]:
    """The served AUROC on ``split`` of ``source``'s records (None when that split is empty or of one class) and the
    scores."""
    frame, hidden = sets.records(source)
    part = frame[frame["split"] == split]
    scores = detector.record_scores(part, hidden)
    try:
        return served_auroc(part, scores, split), scores
    except InputError:  # no record, or one class (OneClassError)
        return None, scores


def train_and_choose(
    sets: TokenSets,
    params: TrainingParams,
    candidates: list[str],
    choose_on: str = CONTINUATIONS,
    default: str | None = None,
    stop_share: float = 0.2,
    **kwargs,
) -> RealtimeDetector:
    """Train one detector per candidate in ``candidates`` (``train_realtime.tokens``) and keep ``default`` (the first
    candidate when None) unless another's served score (max over all of a record's tokens) beats it by a paired
    bootstrap interval of the AUROC above 0 (:func:`~detectors.evaluation.choice.choose`; each interval at the
    :func:`~detectors.evaluation.choice.family_level` of the other candidates, 95 % for all together) on the validation
    records of ``choose_on`` (``continuations`` or ``answers``), records no candidate trained or early-stopped on (a
    ``stop_share`` of that set's train records early-stops instead: :func:`stop_fold`).

    The kept detector's ``info`` records the choice (``tokens``, ``chosen_on``, ``choice``: the rule's record with
    every candidate's difference and the ties), its ``val_served_auroc`` and every candidate's (``candidates``), with
    each candidate's served AUROC on the validation and test records of every set (``served_auroc``: reported, never
    chosen by), the digest of the records ``val_served_auroc`` is computed on (``val_digest``: the ok validation records
    of ``choose_on``, None when there is none), which the register stage compares versions by, and their served scores
    (``validation``, :func:`~detectors.evaluation.choice.scored_units`). Its ``threshold`` is then chosen for serving,
    on the validation records of ``choose_on`` by their max over all tokens (the token-level one stays in
    ``info["token_threshold"]``), because served it fires at the first token that reaches it; a token-level threshold
    fires on most correct records. With one candidate a one-class validation split leaves its served AUROC None (and
    the token-level threshold); with more, it is an error (nothing to choose by).
    """
    default = candidates[0] if default is None else default
    if default not in candidates:
        raise ValueError(f"the default candidate {default!r} is not one of {candidates}")
    sets.records(choose_on)  # the set to choose on exists before anything trains
    sets = dataclasses.replace(sets, judged_on=choose_on, stop_share=stop_share)
    records = sets.records(choose_on)[0]
    trained, served_scores, summary = {}, {}, {}
    for tokens in candidates:
        detector = trained[tokens] = train_realtime_detector(sets, params, tokens=tokens, **kwargs)
        served = {
            source: {split: _served(detector, sets, source, split) for split in ("val", "test")}
            for source in sets.sources
        }
        value, served_scores[tokens] = served[choose_on]["val"]
        if value is None and len(candidates) > 1:
            raise OneClassError(
                f"train_realtime.tokens = {candidates}: cannot choose a candidate by validation (the {choose_on}' "
                f"validation "
                "records are all of one class)"
            )
        summary[tokens] = {
            "val_served_auroc": value,
            "best_val_auroc": detector.info["best_val_auroc"],
            "seed_val_auroc": detector.info["seed_val_auroc"],
            "threshold": detector.threshold,
            "served_auroc": {
                source: {split: auroc for split, (auroc, _) in by_split.items()} for source, by_split in served.items()
            },
        }
        log.info("trained on %s tokens: validation served AUROC on the %s %s", tokens, choose_on, value)
    val_ids = ok_records(records, "val")["id"]  # the records served_auroc scores
    choice, validation = None, None
    if summary[default]["val_served_auroc"] is not None:
        maxima = {t: continuation_maxima(records, served_scores[t], "val") for t in candidates}
        labels = maxima[default][0]
        level = family_level(len(candidates) - 1)
        deltas = auroc_deltas(labels, {t: m for t, (_, m) in maxima.items()}, default, level=level)
        choice = choose(default, deltas, len(labels), level)
        validation = scored_units(val_ids, labels, maxima[choice.chosen][1])
        log.info("kept the %s candidate: %s", choice.chosen, choice.as_dict())
    best = trained[default if choice is None else choice.chosen]
    tokens = best.info["tokens"]
    best.info = {
        **best.info,
        "val_served_auroc": summary[tokens]["val_served_auroc"],
        "chosen_on": choose_on,
        "choice": None if choice is None else choice.as_dict(),
        "val_digest": validation_digest(val_ids) if len(val_ids) else None,
        "validation": validation,
        "candidates": summary,
    }
    if choice is not None:  # serving fires when the max so far reaches the threshold
        token_threshold = best.threshold
        best.threshold = served_threshold(records, served_scores[tokens], params.threshold)
        best.info |= {
            "token_threshold": token_threshold,
            "threshold_chosen_on": f"validation {choose_on} (max over tokens)",
        }
        log.info("served threshold %.4f (token-level %.4f)", best.threshold, token_threshold)
    return best
