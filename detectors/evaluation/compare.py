"""The comparison: every scorer of one level on the same units, thresholds and calibration from the
validation split, metrics on the test split (the only place the test split is read)."""

from __future__ import annotations

import pandas as pd

from detectors.evaluation.metrics import binary_metrics, choose_threshold, platt
from detectors.interfaces import Scorer


def compare(units: pd.DataFrame, scorers: list[Scorer], strategy: str, ece_bins: int) -> tuple[dict, pd.DataFrame]:
    """Metrics per scorer on the test units and every unit's scores (columns ``id, split, label`` and one per scorer).

    A scorer without its own ``threshold`` gets one chosen on validation by ``strategy``; a scorer whose
    scores are not probabilities gets a Platt map fitted on validation for the ECE.
    """
    levels = {s.level for s in scorers}
    if len(levels) > 1:
        raise ValueError(f"compare scorers of one level at a time, got {sorted(level.value for level in levels)}")
    ok = units[units["status"] == "ok"].reset_index(drop=True)
    val, test = ok[ok["split"] == "val"], ok[ok["split"] == "test"]
    scores = ok[["id", "split", "label"]].copy()
    results = {}
    for scorer in scorers:
        scores[scorer.name] = scorer.score(ok)
        s_val, s_test = scores.loc[val.index, scorer.name], scores.loc[test.index, scorer.name]
        threshold = scorer.threshold if scorer.threshold is not None else choose_threshold(val["label"], s_val, strategy)
        prob = s_test if scorer.is_probability else platt(val["label"], s_val)(s_test)
        results[scorer.name] = {"kind": scorer.kind, **binary_metrics(test["label"], s_test, threshold, prob, ece_bins)}
    return results, scores
