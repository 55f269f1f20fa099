"""Training the retrieval-utility trigger (:mod:`detectors.utility.detector`): the two seed ensembles on one corpus's
labels, and every operating threshold chosen on the validation split by the rule every validation choice follows
(:func:`operating_threshold`; :mod:`detectors.evaluation.choice`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from detectors.config.schema import EarlyFeatureParams, TrainingParams
from detectors.dior.early import scalar_features
from detectors.dior.early_detector import collate, per_question
from detectors.dior.nets import EarlyGRU
from detectors.errors import InputError
from detectors.evaluation.choice import choose, family_level, mean_deltas, scored_units
from detectors.evaluation.metrics import require_both_classes
from detectors.llm.fingerprint import Fingerprint
from detectors.registry.artifact import frame_dtype
from detectors.training import fit, training_info
from detectors.utility.detector import (
    GATE_STAGE,
    PRE_STAGE,
    Standardised,
    UtilityDetector,
    UtilityNets,
    gate_row,
    gate_scalars,
)
from detectors.utility.labels import HELPS, HURTS, NEITHER, as_post


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
