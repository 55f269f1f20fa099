"""The comparison: every scorer of one level on the same units, thresholds and calibration from the
validation split, metrics on the test split (the only place the test split is read), for each trained
detector the paired bootstrap difference of its AUROC from the best training-free baseline's (trained baselines, kind
:data:`TRAINED_BASELINE`, such as the logistic probe, are listed apart and never the reference), and for a seed
ensemble the spread of its single seeds' test AUROC (``seeds``, ``seed_auroc_min``/``_max``/``_sd``) beside its own.

Bootstrap intervals resample the units' ``group`` (a continuation's tokens and entities share its record id;
a question or a continuation is its own group), with one seed, so every scorer of a level is measured on the
same resampled examples.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from detectors.errors import InputError
from detectors.evaluation.bootstrap import bootstrap_auroc, paired_bootstrap_delta
from detectors.evaluation.metrics import auroc, binary_metrics, choose_threshold, platt
from detectors.interfaces import Level, Scorer

# The long comparison table: one row per scorer x dataset x level (the shared interface of issue 10).
COLUMNS = (
    "scorer",
    "kind",
    "dataset",
    "level",
    "features",
    "auroc",
    "auroc_ci_low",
    "auroc_ci_high",
    "auprc",
    "accuracy",
    "f1",
    "ece",
    "threshold",
    "trigger_rate",
    "n",
    "positive_rate",
    "delta_auroc",
    "delta_ci_low",
    "delta_ci_high",
    "delta_vs",
    "seeds",
    "seed_auroc_min",
    "seed_auroc_max",
    "seed_auroc_sd",
)
DELTA = ("delta_auroc", "delta_ci_low", "delta_ci_high", "delta_vs")
# ours, trained on the train split by the comparison, training-free
KINDS = (
    "detector",
    "trained baseline",
    "baseline",
)
TRAINED_BASELINE = KINDS[1]
DATASETS = ("early", "realtime")  # the test sets compared (the table's ``dataset`` values)


class MissingScoresError(InputError, ValueError):
    """A scorer gave no score to some evaluated units (its score table lacks their ids)."""


def _require_scores(name: str, scores: pd.Series, ids: pd.Series) -> None:
    missing = ids[scores.isna().to_numpy()]
    if len(missing):
        raise MissingScoresError(
            f"scorer {name!r} has no score for {len(missing)} of {len(ids)} units (e.g. {missing.head(3).tolist()}): "
            "its score table lacks these ids or their values; rerun the stage that writes it on the same data set"
        )


def compare(
    units: pd.DataFrame, scorers: list[Scorer], strategy: str, ece_bins: int, n_bootstrap: int = 1000, seed: int = 0
) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """Metrics per scorer on the test units, every unit's scores (columns ``id, group, split, label`` and one
    per scorer) and the test units' calibrated probabilities (one column per scorer, for reliability diagrams).

    A scorer without its own ``threshold`` gets one chosen on validation by ``strategy``; a scorer whose
    scores are not probabilities gets a Platt map fitted on validation for the ECE. A detector's metrics
    also hold ``delta_auroc``/``delta_ci_low``/``delta_ci_high`` against ``delta_vs``, the training-free baseline of
    the highest test AUROC (the strongest competitor: conservative for the detector's claim). A scorer with ``seeds``
    (one scorer per seed of its seed ensemble) also holds the spread of their test AUROCs: ``seeds`` (how many),
    ``seed_auroc_min``, ``seed_auroc_max`` and ``seed_auroc_sd`` (their standard deviation, n - 1).
    """
    levels = {s.level for s in scorers}
    if len(levels) > 1:
        raise ValueError(f"compare scorers of one level at a time, got {sorted(level.value for level in levels)}")
    ok = units[units["status"] == "ok"].reset_index(drop=True)
    if "group" not in ok:
        ok = ok.assign(group=ok["id"])
    evaluated = ok["split"].isin(["val", "test"]).to_numpy()
    val, test = ok[ok["split"] == "val"], ok[ok["split"] == "test"]
    scores = ok[["id", "group", "split", "label"]].copy()
    results, probabilities = {}, pd.DataFrame(index=test.index)
    for scorer in scorers:
        scores[scorer.name] = scorer.score(ok)
        _require_scores(scorer.name, scores.loc[evaluated, scorer.name], ok.loc[evaluated, "id"])
        s_val, s_test = scores.loc[val.index, scorer.name], scores.loc[test.index, scorer.name]
        threshold = (
            scorer.threshold if scorer.threshold is not None else choose_threshold(val["label"], s_val, strategy)
        )
        prob = s_test.to_numpy() if scorer.is_probability else platt(val["label"], s_val)(s_test)
        probabilities[scorer.name] = prob
        metrics = binary_metrics(test["label"], s_test, threshold, prob, ece_bins)
        low, high = bootstrap_auroc(test["label"], s_test, test["group"], n_bootstrap, seed)
        results[scorer.name] = {
            "kind": scorer.kind,
            "auroc": metrics.pop("auroc"),
            "auroc_ci_low": low,
            "auroc_ci_high": high,
        }
        results[scorer.name] |= metrics | seed_spread(scorer, ok, test.index)
    baselines = {s.name: results[s.name]["auroc"] for s in scorers if s.kind == "baseline"}
    if baselines:
        best = max(baselines, key=lambda name: baselines[name])
        for scorer in scorers:
            if scorer.kind == "detector":
                pair = _test_scores(scores, scorer.name), _test_scores(scores, best)
                delta = paired_bootstrap_delta(test["label"], *pair, test["group"], n_bootstrap, seed)
                results[scorer.name] |= dict(zip(DELTA, (*delta, best)))
    return results, scores, probabilities


def seed_spread(scorer: Scorer, units: pd.DataFrame, test: pd.Index) -> dict[str, float]:
    """The test AUROC of each of ``scorer``'s single seeds (its ``seeds``: one scorer each) summarised: how many, the
    lowest, the highest and their standard deviation; nothing for a scorer without seeds."""
    members = getattr(scorer, "seeds", ())
    if not members:
        return {}
    labels = units.loc[test, "label"].to_numpy()
    values = np.array([auroc(labels, np.asarray(m.score(units), dtype=np.float64)[test]) for m in members])
    return {
        "seeds": len(values),
        "seed_auroc_min": float(values.min()),
        "seed_auroc_max": float(values.max()),
        "seed_auroc_sd": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
    }


def _test_scores(scores: pd.DataFrame, name: str) -> np.ndarray:
    return scores.loc[scores["split"] == "test", name].to_numpy(dtype=np.float64)


def long_table(results: dict, scorers: list[Scorer], dataset: str) -> pd.DataFrame:
    """The rows of one dataset's comparison (``results[level][scorer]`` from :func:`compare`), one per scorer
    and level, in :data:`COLUMNS`; the delta columns are empty for baselines."""
    features = {(s.level.value, s.name): s.features for s in scorers}
    rows = [
        {"scorer": name, "dataset": dataset, "level": level, "features": features[level, name], **m}
        for level, by_scorer in results.items()
        for name, m in by_scorer.items()
    ]
    return pd.DataFrame(rows).reindex(columns=list(COLUMNS))


def compare_levels(
    units: dict[Level, pd.DataFrame],
    scorers: dict[Level, list[Scorer]],
    strategy: str,
    ece_bins: int,
    n_bootstrap: int,
    seed: int,
) -> tuple[dict, pd.DataFrame, dict[str, pd.DataFrame]]:
    """:func:`compare` at every level of one dataset: ``{level: {scorer: metrics}}``, the units' scores of all
    levels (column ``level`` added) and the test probabilities per level."""
    results, all_scores, probabilities = {}, [], {}
    for level, table in units.items():
        results[level.value], scores, probabilities[level.value] = compare(
            table, scorers[level], strategy, ece_bins, n_bootstrap, seed
        )
        all_scores.append(scores.assign(level=level.value))
    return results, pd.concat(all_scores, ignore_index=True), probabilities
