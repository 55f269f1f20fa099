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

Both networks are seed ensembles (``training.seeds`` nets, their mean probability: :mod:`detectors.ensemble`).
Operating points are chosen on the validation split only, by the rule every validation choice follows
(:mod:`detectors.evaluation.choice`, :func:`operating_threshold`): a fixed target, the point of the validation curve
(accuracy vs retrieval rate) whose rate is nearest the share of questions the passages help (the gate: the share they
do not hurt), kept unless a point at another retrieval rate (0 %, 10 %, ..., 100 %) answers more questions right by a
paired 95 % bootstrap interval above 0. ``threshold``: that point; ``budget_threshold``: the same among the points
retrieving at most ``budget`` of the questions; ``gate_threshold``: the gate's (every validation question as
retrieved). The RAG evaluation chooses its own operating threshold on its validation sweep.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from detectors.config.core import from_dict
from detectors.config.schema import EarlyFeatureParams, TrainingParams
from detectors.dior.early import features_to_row, question_features, scalar_features
from detectors.dior.early_detector import collate, per_question
from detectors.dior.nets import EarlyGRU
from detectors.ensemble import build_net, members
from detectors.errors import InputError
from detectors.evaluation.choice import choose, family_level, mean_deltas, scored_units
from detectors.evaluation.metrics import require_both_classes
from detectors.interfaces import Detector
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.layers import hidden_state_indices
from detectors.registry.artifact import FrameInputs, frame_dtype, llm_section, read_net, write_artifact
from detectors.training import fit, predict, training_info
from detectors.utility.labels import HELPS, HURTS, NEITHER, as_post, post_features

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
class UtilityDetector(Detector):
    """Retrieve for this question, and keep the passages retrieved? (see the module's docstring)."""

    KIND = "utility"
    DECIDES = "question"
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

    # ---- artifact -------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        config = {
            "name": self.name,
            "corpus": self.corpus,
            "net": self.nets.config,
            "pre_groups": self.pre_groups,
            "pre_inputs": self.pre_inputs.to_dict(),
            "gate_inputs": self.gate_inputs.to_dict(),
            "k": self.k,
            "threshold": self.threshold,
            "budget_threshold": self.budget_threshold,
            "gate_threshold": self.gate_threshold,
            "features": dataclasses.asdict(self.features),
            "llm": llm_section(self.fingerprint, self.llm_ref),
            "info": self.info,
        }
        return write_artifact(directory, self.KIND, self.nets, config)

    @classmethod
    def load(cls, directory: str | Path) -> UtilityDetector:
        config, nets, fingerprint, llm_ref = read_net(directory, cls.KIND, UtilityNets)
        return cls(
            nets=nets,
            corpus=config["corpus"],
            pre_groups=config["pre_groups"],
            pre_inputs=Standardised.from_dict(config["pre_inputs"]),
            gate_inputs=Standardised.from_dict(config["gate_inputs"]),
            k=int(config["k"]),
            threshold=float(config["threshold"]),
            budget_threshold=float(config["budget_threshold"]),
            gate_threshold=float(config["gate_threshold"]),
            features=from_dict(EarlyFeatureParams, config["features"], "detector.features"),
            fingerprint=fingerprint,
            llm_ref=llm_ref,
            info=config["info"],
            name=config["name"],
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


# ---- training ---------------------------------------------------------------------------------------------


def joined(labels: pd.DataFrame, early: pd.DataFrame) -> pd.DataFrame:
    """The usable labels rows of one corpus with the early set's columns of their usable questions (by id). ``labels``
    may hold every row: :func:`~detectors.utility.labels.utility_records`' (a question the loop could not answer has
    an ``error``) or the labels table's (its ``status`` is not ok); either way such a row has no ``utility`` label,
    and only the labelled rows are kept."""
    ok = labels[labels["utility"].notna()] if "utility" in labels.columns else labels.iloc[:0]
    cols = [c for c in early.columns if c not in ok.columns or c == "id"]
    return ok.merge(early[early["status"] == "ok"][cols], on="id", how="inner")


RATES = tuple(i / 10 for i in range(11))  # the retrieval rates whose points compete with the fixed target
TARGET = "target"  # the fixed target's name in a choice


def operating_threshold(
    scores: np.ndarray, rows: pd.DataFrame, target: float, budget: float | None = None
) -> tuple[float, dict]:
    """A question score's validation operating threshold by the rule, and the choice's record: the point of the
    accuracy vs retrieval-rate curve (:func:`~detectors.evaluation.rag_sweep.curve`) retrieving nearest ``target`` of
    the questions, unless the point nearest one of :data:`RATES` answers more of them right by a paired bootstrap
    interval above 0 (:func:`~detectors.evaluation.choice.choose` on each question's correctness, each interval at the
    :func:`~detectors.evaluation.choice.family_level` of the eleven). With ``budget``,
    only points retrieving at most that share compete."""
    from detectors.evaluation.rag_sweep import curve, question_outcomes

    without, with_ = rows["correct_without"].to_numpy(bool), rows["correct_with"].to_numpy(bool)
    c = curve("utility", question_outcomes(scores, without, with_))
    allowed = np.flatnonzero(c.retrieval_rate <= (1.0 if budget is None else budget) + 1e-12)

    def nearest(rate: float) -> int:
        return int(allowed[np.argmin(np.abs(c.retrieval_rate[allowed] - rate))])  # the first: the highest threshold

    points = {TARGET: nearest(target)} | {f"{rate:.0%}": nearest(rate) for rate in RATES}
    correct = {name: np.where(scores >= c.threshold[i], with_, without).astype(float) for name, i in points.items()}
    level = family_level(len(points) - 1)
    choice = choose(TARGET, mean_deltas(correct, TARGET, level=level), len(rows), level)
    chosen = points[choice.chosen]
    record = choice.as_dict() | {
        "target_rate": round(float(target), 4),
        "retrieval_rates": {name: round(float(c.retrieval_rate[i]), 4) for name, i in points.items()},
    }
    return float(c.threshold[chosen]), record


def train_utility_detector(
    rows: pd.DataFrame,
    corpus: str,
    pre_groups: list[str],
    params: TrainingParams,
    budget: float,
    k: int,
    features: EarlyFeatureParams,
    fingerprint: Fingerprint,
    llm_ref: dict[str, Any],
    name: str,
    fast_dev_run: bool = False,
) -> UtilityDetector:
    """Train both networks on the ``train`` split of ``rows`` (:func:`joined` labels of ``corpus``) with
    ``params.seeds`` seeds each, early-stop and choose every threshold on ``val`` (never on test:
    :func:`operating_threshold`, its choices in ``info["choices"]``). ``info["validation"]``: the retrieval decision's
    validation scores (:func:`~detectors.evaluation.choice.scored_units`), which the registry compares versions on."""
    llm_ref = {**llm_ref, "dtype": frame_dtype(rows, f"the {corpus} utility labels' early columns")}
    train, val = (rows[rows["split"] == s].to_dict("records") for s in ("train", "val"))
    # a small sample can leave a corpus without a split or a class: more questions, or no trigger for that corpus
    fix = f"Use more questions (qa.limit) or leave {corpus} out of build_utility.corpora."
    if not train or not val:
        raise InputError(
            f"the {corpus} utility labels have {len(train)} train and {len(val)} val questions: both splits are "
            f"needed. {fix}"
        )
    nets: dict[str, EarlyGRU] = {}
    inputs: dict[str, Standardised] = {}
    summaries: dict[str, dict] = {}
    changed = lambda rows: [r for r in rows if r["utility"] != NEITHER]  # noqa: E731 - where the gate's decision matters
    for stage, used, featurize, n_scalars in (
        (
            PRE_STAGE,
            lambda rows: rows,
            lambda r: per_question(r, pre_groups),
            len(scalar_features(train[0], pre_groups)),
        ),
        (GATE_STAGE, changed, lambda r: gate_row(r, as_post(r), k), len(gate_scalars(train[0], as_post(train[0]), k))),
    ):
        data = {"train": used(train), "val": used(val)}
        raw = {split: np.stack([featurize(r) for r in rows]) for split, rows in data.items()}
        y = {split: np.array([int(r["utility"] == HELPS) for r in rows]) for split, rows in data.items()}
        for split in ("train", "val"):
            require_both_classes(
                y[split], f"the {corpus} corpus's {split} split of the {stage} labels", repr(HELPS), fix
            )
        inputs[stage] = Standardised.fit(raw["train"], n_scalars)
        width = raw["train"].shape[1] - n_scalars
        nets[stage], summaries[stage] = fit(
            lambda: EarlyGRU(0, n_scalars, width, params.hidden, params.dropout),
            inputs[stage].items(raw["train"], y["train"]),
            inputs[stage].items(raw["val"], y["val"]),
            collate,
            params,
            fast_dev_run=fast_dev_run,
        )
        summaries[stage].update(
            n_train=len(data["train"]), n_val=len(data["val"]), helps_rate_train=float(y["train"].mean())
        )
    bundle = UtilityNets(nets[PRE_STAGE].config, nets[GATE_STAGE].config)
    bundle.pre.load_state_dict(nets[PRE_STAGE].state_dict())
    bundle.gate.load_state_dict(nets[GATE_STAGE].state_dict())
    detector = UtilityDetector(
        bundle,
        corpus,
        list(pre_groups),
        inputs[PRE_STAGE],
        inputs[GATE_STAGE],
        k,
        0.5,
        0.5,
        0.5,
        features,
        fingerprint,
        llm_ref,
        {},
        name=name,
    )
    val_frame = pd.DataFrame(val)
    pre_val = detector.predict_proba(val)
    gate_val = detector.gate_proba(val, [as_post(r) for r in val])  # every val question as retrieved
    helps = (val_frame["utility"] == HELPS).to_numpy()
    hurts = (val_frame["utility"] == HURTS).to_numpy()
    choices = {}
    detector.threshold, choices["threshold"] = operating_threshold(pre_val, val_frame, helps.mean())
    detector.budget_threshold, choices["budget_threshold"] = operating_threshold(
        pre_val, val_frame, helps.mean(), budget
    )
    detector.gate_threshold, choices["gate_threshold"] = operating_threshold(gate_val, val_frame, 1 - hurts.mean())
    detector.info = training_info(
        summaries[PRE_STAGE],
        params,
        n_train=len(train),
        n_val=len(val),
        budget=budget,
        gate=summaries[GATE_STAGE],
        val_retrieval_rate=float(np.mean(pre_val >= detector.threshold)),
        val_retrieval_rate_at_budget=float(np.mean(pre_val >= detector.budget_threshold)),
        val_gate_keep_rate=float(np.mean(gate_val >= detector.gate_threshold)),
        choices=choices,
        validation=scored_units(val_frame["id"], helps.astype(int), pre_val),
    )
    return detector
