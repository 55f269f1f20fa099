"""The retrieval-utility trigger: learns the retrieval decision itself (SKR, Probing-RAG), with a post-retrieval gate.

Two networks (the early detectors' :class:`~detectors.dior.nets.EarlyGRU`, so logit features go straight into the
head and hidden states through a projection), trained in Lightning on the train split of one corpus's labels
(:mod:`detectors.utility.labels`):

- **retrieve?** (before retrieval): P(``helps``) from the early set's columns of the question (``pre_groups``: the
  first-token statistics and the last-prompt hidden state by default), the question trigger the RAG loop reads;
- **keep the passages?** (the gate, after retrieval, before the answer): P(``helps`` | the passages change whether the
  answer is right), trained on the ``helps`` and ``hurts`` questions only (where the decision matters), from the same
  columns, the first-token statistics and last-prompt hidden state with the passages in the prompt and the
  retriever's scores. The loop answers without the passages when it is below ``gate_threshold``.

Both networks are seed ensembles (``training.seeds`` nets, their mean probability: :mod:`detectors.ensemble`), trained
by :mod:`detectors.utility.training`. Operating points are chosen on the validation split only, by the rule every
validation choice follows (:mod:`detectors.evaluation.choice`,
:func:`~detectors.utility.training.operating_threshold`): a fixed target, the point of the validation curve
(accuracy vs retrieval rate) whose rate is nearest the share of questions the passages help (the gate: the share they
do not hurt), kept unless a point at another retrieval rate (0 %, 10 %, ..., 100 %) answers more questions right by a
paired 95 % bootstrap interval above 0. ``threshold``: that point; ``budget_threshold``: the same among the points
retrieving at most ``budget`` of the questions; ``gate_threshold``: the gate's (every validation question as
retrieved). The RAG evaluation chooses its own operating threshold on its validation sweep.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from detectors.config.schema import EarlyFeatureParams
from detectors.dior.early import features_to_row, question_features, scalar_features
from detectors.dior.early_detector import collate, per_question
from detectors.dior.nets import EarlyGRU
from detectors.ensemble import build_net, members
from detectors.interfaces import Detector, Registration
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.layers import hidden_state_indices
from detectors.registry.artifact import DeclaredArtifact, FrameInputs
from detectors.training import predict
from detectors.utility.labels import post_features

PRE_STAGE, GATE_STAGE = "pre", "gate"


class UtilityNets(nn.Module):
    """The two networks of a utility trigger, saved as one artifact (``pre.*`` and ``gate.*`` weights)."""

    def __init__(self, pre: dict[str, Any], gate: dict[str, Any]):
        super().__init__()
        self.pre, self.gate = build_net(EarlyGRU, pre), build_net(EarlyGRU, gate)
        self.config = {"pre": pre, "gate": gate}


def gate_scalars(pre: dict, post: dict, k: int) -> np.ndarray:
    """The gate's scalars: the first-token statistics without and with the passages, and the retriever's ``k`` scores
    (best first; missing passages score 0) with how many came back."""
    scores = sorted((float(s) for s in post["retrieval_scores"]), reverse=True)[:k]
    return np.concatenate(
        [
            scalar_features(pre, ["first_token"]),
            scalar_features(post, ["first_token"]),
            np.array(scores + [0.0] * (k - len(scores)) + [len(scores)], dtype=np.float32),
        ]
    ).astype(np.float32)


def gate_row(pre: dict, post: dict, k: int) -> np.ndarray:
    """Scalars then the hidden state with the passages: the gate's features, standardised together."""
    return np.concatenate([gate_scalars(pre, post, k), np.asarray(post["hidden"], dtype=np.float32)])


def _items(raw: np.ndarray, labels: np.ndarray, mean: np.ndarray, std: np.ndarray, n_scalars: int) -> list[dict]:
    z = torch.from_numpy(((raw - mean) / std).astype(np.float32))
    return [{"label": int(y), "scalars": z[i, :n_scalars], "vector": z[i, n_scalars:]} for i, y in enumerate(labels)]


@dataclasses.dataclass
class Standardised:
    """One network's inputs: the train statistics of its features and how many of them are scalars."""

    mean: np.ndarray
    std: np.ndarray
    n_scalars: int

    def items(self, raw: np.ndarray, labels: np.ndarray | None = None) -> list[dict]:
        return _items(
            raw, np.zeros(len(raw), dtype=int) if labels is None else labels, self.mean, self.std, self.n_scalars
        )

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.tolist(), "std": self.std.tolist(), "n_scalars": self.n_scalars}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Standardised:
        return cls(np.asarray(d["mean"], dtype=np.float32), np.asarray(d["std"], dtype=np.float32), int(d["n_scalars"]))

    @classmethod
    def fit(cls, raw: np.ndarray, n_scalars: int) -> Standardised:
        return cls(raw.mean(axis=0).astype(np.float32), (raw.std(axis=0) + 1e-6).astype(np.float32), n_scalars)


@dataclasses.dataclass
class UtilityDetector(DeclaredArtifact, Detector):
    """Retrieve for this question, and keep the passages retrieved? (see the module's docstring)."""

    KIND = "utility"
    DECIDES = "question"
    TRIGGER = "utility"
    NET = "nets"
    INPUTS = FrameInputs({"question": "string"})

    nets: UtilityNets
    corpus: str  # the corpus whose passages its labels were measured with
    pre_groups: list[str]
    pre_inputs: Standardised
    gate_inputs: Standardised
    k: int  # passages per retrieval the gate's scores were measured with
    threshold: float  # retrieve when P(helps) >= this (validation's most accurate point)
    budget_threshold: float  # the most accurate point retrieving at most ``info['budget']`` of validation questions
    gate_threshold: float  # keep the passages when P(helps | they change the answer's correctness) >= this
    features: EarlyFeatureParams
    fingerprint: Fingerprint
    llm_ref: dict[str, Any]
    info: dict[str, Any]
    llm: Any = None
    name: str = KIND

    @property
    def groups(self) -> list[str]:
        """The early-set columns the retrieval decision reads (the comparison's ``features``)."""
        return self.pre_groups

    @property
    def state_indices(self) -> list[int]:
        """The hidden-state indices the gate reads at the last prompt token (``features.hidden_layers``)."""
        return hidden_state_indices(
            self.features.hidden_layers, self.fingerprint.num_layers, "build_early.features.hidden_layers"
        )

    # ---- scoring --------------------------------------------------------------------------------
    def predict_proba(self, rows: list[dict] | pd.DataFrame) -> np.ndarray:
        """P(retrieval helps) of questions from their early-set columns."""
        rows = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else rows
        raw = (
            np.stack([per_question(r, self.pre_groups) for r in rows])
            if rows
            else np.zeros((0, len(self.pre_inputs.mean)), np.float32)
        )
        return predict(self.nets.pre, self.pre_inputs.items(raw), collate)

    def gate_proba(self, pre_rows: list[dict], post_rows: list[dict]) -> np.ndarray:
        """P(the passages fix the answer rather than break it) from the question's early-set columns and the
        post-retrieval ones (``first_token_*``, ``hidden``, ``retrieval_scores``)."""
        if not pre_rows:
            return np.zeros(0, dtype=np.float32)
        raw = np.stack([gate_row(pre, post, self.k) for pre, post in zip(pre_rows, post_rows)])
        return predict(self.nets.gate, self.gate_inputs.items(raw), collate)

    def registration(self) -> Registration:
        """Only a version of the same corpus and question features competes with the champion."""
        features = ",".join(self.pre_groups)
        return Registration(f"{self.corpus}: {features}", {"corpus": self.corpus, "features": features})

    def per_seed(self) -> list[UtilityDetector]:
        """One detector per seed of a seed ensemble (each with its own pair of nets), for the spread across seeds; none
        for a trigger trained with one seed."""
        pairs = list(zip(members(self.nets.pre), members(self.nets.gate)))
        out = []
        for pre, gate in pairs if len(pairs) > 1 else ():
            nets = UtilityNets(pre.config, gate.config)
            nets.pre, nets.gate = pre, gate
            out.append(dataclasses.replace(self, nets=nets))
        return out

    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        """pyfunc view: a ``question`` column in; P(retrieval helps) and the decision at the validation threshold
        out."""
        llm = self.require_llm()
        probs = [
            float(self.predict_proba([features_to_row(question_features(llm, str(q), self.features))])[0])
            for q in frame["question"]
        ]
        return pd.DataFrame({"probability": probs, "retrieve": [p >= self.threshold for p in probs]})


class UtilityGate:
    """A utility detector's gate in the RAG loop (:class:`~detectors.rag.triggers.Gate`): it reads the last prompt
    token's hidden states through its probe and keeps the passages when the gate's P(helps) >= ``gate_threshold``."""

    key = "utility-gate"

    def __init__(self, detector: UtilityDetector):
        from detectors.llm.layers import StateTap

        self.detector, self.threshold = detector, detector.gate_threshold
        self.probe = StateTap(detector.require_llm().model, detector.state_indices)

    def judge(self, items: list) -> list[float]:
        return [
            float(s)
            for s in self.detector.gate_proba([i.question_stats for i in items], [post_features(i) for i in items])
        ]
