"""The trained early detector: training from the early-detection set, its artifact, and serving.

DioR's early detector (§3.1.1, Alg. 1, App. A.1) is an RNN over the question's IG features: Eq. 2 reads
C(Q) = 1[Softmax(f_RNN(IG(Q))) > 0.5], with IG(Q) the Integrated-Gradients attribution of each question
token and its entropy (Eq. 1). Alg. 1 also lists the answer A and the reference R among the RNN's inputs
while training, but neither exists before generation, and the label is computed from them, so the detector
the paper serves (Eq. 2) reads IG(Q) alone. Feature groups ``[attribution, entropy]`` are exactly that: the
GRU (an RNN) reads the attribution sequence, the entropy joins its head; this is ``dior-early``. Further
groups (``first_token``, ``hidden``) make a stronger detector that is not DioR's (``dior-early-extended``
in params.yaml). One sigmoid logit is Eq. 2's two-class softmax; the paper retrieves when it exceeds
:data:`PAPER_THRESHOLD` = 0.5. The detector retrieves at the threshold chosen on validation instead (the
comparison's rule for every scorer: 0.5 assumes calibrated, balanced training), and records the paper's
threshold and both thresholds' validation trigger rates in ``info``.

The artifact is a directory: ``weights.safetensors`` (no pickle) and ``detector.json`` (its name, network
shape, feature groups, standardisation, validation threshold, feature params incl. the prompt, the
LLM fingerprint and the dtype the features were computed in). Serving computes features with the same
``question_features`` as build_early.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.nn.utils.rnn import pad_sequence

from detectors.config.schema import EarlyFeatureParams, TrainingParams
from detectors.dior.early import (
    SEQUENCE_DIM,
    features_to_row,
    question_features,
    scalar_features,
    sequence_features,
    vector_features,
)
from detectors.dior.nets import EarlyGRU
from detectors.ensemble import per_seed
from detectors.evaluation.choice import scored_units
from detectors.evaluation.metrics import choose_threshold, require_both_classes
from detectors.interfaces import Detector, Registration
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.loading import LLM
from detectors.registry.artifact import DeclaredArtifact, FrameInputs, frame_dtype
from detectors.sources.ids import ok_records
from detectors.training import fit, predict, training_info

PAPER_THRESHOLD = 0.5  # DioR Eq. 2: retrieve when the softmax (here: sigmoid) output exceeds 0.5


@dataclasses.dataclass
class EarlyDecision:
    """The answer to "retrieve before generating?" for one question."""

    probability: float  # P(hallucination) from the detector
    retrieve: bool  # probability >= the threshold chosen on validation data
    keywords: list[str]  # DioR Eq. 3 keyword candidates for the retrieval query
    entropy: float  # attribution entropy (Eq. 1)
    question_tokens: list[str]
    attribution: list[float]


def per_question(row: dict, groups: list[str]) -> np.ndarray:
    """Scalars then vector: the per-question features, standardised together with train statistics."""
    return np.concatenate([scalar_features(row, groups), vector_features(row, groups)])


def _items(rows: list[dict], groups: list[str], mean: np.ndarray, std: np.ndarray, n_scalars: int) -> list[dict]:
    items = []
    for row in rows:
        z = torch.from_numpy((per_question(row, groups) - mean) / std).float()
        item: dict[str, Any] = {"label": int(row.get("label", 0)), "scalars": z[:n_scalars], "vector": z[n_scalars:]}
        if "attribution" in groups:
            item["seq"] = torch.from_numpy(sequence_features(row["attribution"]))
        items.append(item)
    return items


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    batch = {key: torch.stack([it[key] for it in items]) for key in ("scalars", "vector")}
    batch["label"] = torch.tensor([it["label"] for it in items])
    if "seq" in items[0]:
        batch["seq"] = pad_sequence([it["seq"] for it in items], batch_first=True)
        batch["lengths"] = torch.tensor([len(it["seq"]) for it in items])
    return batch


@dataclasses.dataclass
class EarlyDetector(DeclaredArtifact, Detector):
    """The GRU over a question's attribution sequence (plus per-question features): retrieve before generating?

    ``name`` says which of the trained early detectors it is (``dior-early``, ``dior-early-extended``, an ablation
    ``gru[...]``); all share the kind ``dior-early``. Artifacts written before names were recorded load as
    ``dior-early``.
    """

    KIND = "dior-early"
    DECIDES = "question"
    TRIGGER = "early"
    INPUTS = FrameInputs({"question": "string"})

    net: EarlyGRU
    groups: list[str]
    static_mean: np.ndarray
    static_std: np.ndarray
    threshold: float
    features: EarlyFeatureParams
    fingerprint: Fingerprint
    # where the training LLM came from and its feature dtype: {"dir", "source", "gguf_file", "dtype"}
    llm_ref: dict[str, Any]
    info: dict[str, Any]
    llm: LLM | None = None
    name: str = KIND

    def per_seed(self) -> list[EarlyDetector]:
        """The detector once per seed of its seed ensemble (none when trained with one seed)."""
        return per_seed(self)

    def registration(self) -> Registration:
        """Only a version of the same feature groups competes with the champion."""
        features = ",".join(self.groups)
        return Registration(features, {"detector": self.name, "features": features})

    # ---- scoring --------------------------------------------------------------------------------
    def predict_proba(self, rows: list[dict] | pd.DataFrame) -> np.ndarray:
        """P(hallucination) for stored feature rows (the early-detection set's schema)."""
        rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows
        items = _items(rows, self.groups, self.static_mean, self.static_std, self.net.config["scalar_dim"])
        return predict(self.net, items, collate)

    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        """pyfunc view: a ``question`` column in; probability, retrieve and keywords out."""
        decisions = [self.assess(str(q)) for q in frame["question"]]
        return pd.DataFrame(
            {
                "probability": [d.probability for d in decisions],
                "retrieve": [d.retrieve for d in decisions],
                "keywords": [d.keywords for d in decisions],
            }
        )

    def assess(self, question: str) -> EarlyDecision:
        """Should the RAG loop retrieve before generating an answer to ``question``?"""
        f = question_features(self.require_llm(), question, self.features)
        prob = float(self.predict_proba([features_to_row(f)])[0])
        return EarlyDecision(
            probability=prob,
            retrieve=prob >= self.threshold,
            keywords=f.keywords,
            entropy=f.entropy,
            question_tokens=f.question_tokens,
            attribution=f.attribution.tolist(),
        )


def train_early_detector(
    frame: pd.DataFrame,
    groups: list[str],
    params: TrainingParams,
    features: EarlyFeatureParams,
    fingerprint: Fingerprint,
    llm_ref: dict[str, Any],
    fast_dev_run: bool = False,
    name: str = EarlyDetector.KIND,
) -> EarlyDetector:
    """Train detector ``name`` on the ``train`` split with ``params.seeds`` seeds (their mean probability,
    :func:`~detectors.training.fit`), early-stop and choose the threshold on ``val`` (never on test).

    The detector records the dtype the set's features were computed in (its ``feature_dtype`` column) in
    ``llm_ref``, so that serving in another dtype is refused, and its validation scores (``info["validation"]``,
    :func:`~detectors.evaluation.choice.scored_units`), which the registry's champion rule compares versions on.
    """
    llm_ref = {**llm_ref, "dtype": frame_dtype(frame, "the early-detection set")}
    train, val = (ok_records(frame, split).to_dict("records") for split in ("train", "val"))
    train_labels, val_labels = (np.array([r["label"] for r in rows]) for rows in (train, val))
    require_both_classes(train_labels, "the train split")
    require_both_classes(val_labels, "the validation split")
    raw = np.stack([per_question(r, groups) for r in train])
    mean, std = raw.mean(axis=0), raw.std(axis=0) + 1e-6
    n_scalars = len(scalar_features(train[0], groups))
    net, summary = fit(
        lambda: EarlyGRU(
            SEQUENCE_DIM if "attribution" in groups else 0,
            n_scalars,
            raw.shape[1] - n_scalars,
            params.hidden,
            params.dropout,
        ),
        _items(train, groups, mean, std, n_scalars),
        _items(val, groups, mean, std, n_scalars),
        collate,
        params,
        fast_dev_run=fast_dev_run,
    )
    detector = EarlyDetector(
        net, list(groups), mean, std, PAPER_THRESHOLD, features, fingerprint, llm_ref, {}, name=name
    )
    val_scores = detector.predict_proba(val)
    detector.threshold = choose_threshold(val_labels, val_scores, params.threshold)
    detector.info = training_info(
        summary,
        params,
        n_train=len(train),
        n_val=len(val),
        train_hallucination_rate=float(train_labels.mean()),
        paper_threshold=PAPER_THRESHOLD,
        val_trigger_rate=float(np.mean(val_scores >= detector.threshold)),
        val_trigger_rate_at_paper_threshold=float(np.mean(val_scores > PAPER_THRESHOLD)),
        validation=scored_units([r["id"] for r in val], val_labels, val_scores),
    )
    return detector


def load_early_detectors(directory: str | Path) -> dict[str, EarlyDetector]:
    """Every trained early detector under ``directory`` (``paths.early_model``), by name: one per sub-directory, in
    name order. A sub-directory whose artifact carries another name, or a directory with none, is an error."""
    directory = Path(directory)
    subdirs = sorted(d for d in directory.iterdir() if d.is_dir()) if directory.is_dir() else []
    if not subdirs:
        raise FileNotFoundError(
            f"{directory} holds no trained early detector (one per sub-directory): run `dvc repro train_early`"
        )
    detectors = {}
    for sub in subdirs:
        detector = EarlyDetector.load(sub)
        if detector.name != sub.name:
            raise ValueError(
                f"{sub} holds early detector {detector.name!r}, not {sub.name!r}: rerun `dvc repro train_early`"
            )
        detectors[sub.name] = detector
    return detectors
