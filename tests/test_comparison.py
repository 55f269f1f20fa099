"""The comparison's statistics and outputs on hand-made data: clustered and paired bootstrap intervals,
trigger rates, the detector-vs-best-baseline difference, trained baselines apart, a seed ensemble's spread, inverted
scorers, the long table, its Markdown, score-table joins and the scorers' stable colours."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pandas as pd
import pytest

from detectors.baselines.catalog import realtime_baselines
from detectors.config.core import ParamsError
from detectors.config.evaluation import EvaluateParams
from detectors.evaluation.bootstrap import (
    _cluster_counts,
    bootstrap_auroc,
    clustered_auroc,
    paired_bootstrap_delta,
)
from detectors.evaluation.compare import COLUMNS, MissingScoresError, compare, long_table
from detectors.evaluation.inputs import join_score_tables
from detectors.evaluation.metrics import auroc, binary_metrics, trigger_rate
from detectors.evaluation.plots import reliability, scorer_colours
from detectors.evaluation.report import markdown_table, nested_metrics
from detectors.evaluation.scorers import ColumnScorer
from detectors.evaluation.units import realtime_token_stats, realtime_units
from detectors.interfaces import Level


def test_vectorised_auroc_equals_the_auroc_of_each_resample_with_ties():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 80)
    s = np.round(y + rng.normal(0, 1, 80), 1)  # rounded: many ties
    groups = np.repeat(np.arange(20), 4)
    index, counts = _cluster_counts(groups, 25, seed=3)
    weights = counts[:, index]  # how often each unit is drawn in each resample
    assert weights.shape == (25, 80) and (weights.sum(1) == 80).all()  # 20 clusters of 4 drawn 20 times
    for w, got in zip(weights, clustered_auroc(y, s, index, counts)):  # the sparse path = the AUROC of each resample
        idx = np.repeat(np.arange(80), w.astype(int))
        expected = auroc(y[idx], s[idx]) if 0 < y[idx].sum() < len(idx) else np.nan
        assert got == pytest.approx(expected, nan_ok=True)
    # a unit's cluster is drawn as a whole: all its units get the same weight
    assert (weights.reshape(25, 20, 4) == weights.reshape(25, 20, 4)[:, :, :1]).all()


def test_clustered_bootstrap_width_follows_the_number_of_clusters_not_of_units():
    """Eight copies of each of 60 units (tokens of one continuation sharing a label and a score) carry no more
    information than the 60 units: resampling continuations gives exactly their interval, resampling tokens a
    much narrower, falsely precise one."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 60)
    s = y + rng.normal(0, 1.2, 60)
    low, high = bootstrap_auroc(y, s, n=1000, seed=0)
    y8, s8, groups = np.repeat(y, 8), np.repeat(s, 8), np.repeat(np.arange(60), 8)
    c_low, c_high = bootstrap_auroc(y8, s8, groups, n=1000, seed=0)
    assert (c_low, c_high) == pytest.approx((low, high))
    assert c_low <= auroc(y8, s8) <= c_high
    t_low, t_high = bootstrap_auroc(y8, s8, n=1000, seed=0)  # every token its own cluster
    assert t_high - t_low < 0.6 * (high - low)


def test_paired_difference_recovers_a_planted_difference():
    """Scores y*1.5 + e and y*0.5 + e (the same noise e ~ N(0, 1)): AUROCs Φ(1.5/√2) and Φ(0.5/√2), a planted
    difference of 0.218; pairing cancels the shared noise, so its interval is far narrower than either AUROC's."""
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 3000)
    e = rng.normal(0, 1, 3000)
    strong, weak = 1.5 * y + e, 0.5 * y + e
    planted = 0.5 * (math.erf(1.5 / 2) - math.erf(0.5 / 2))  # Φ(d/√2) = (1 + erf(d/2)) / 2
    delta, low, high = paired_bootstrap_delta(y, strong, weak, n=1000, seed=0)
    assert delta == pytest.approx(auroc(y, strong) - auroc(y, weak))
    assert low < planted < high and low > 0.15
    w_low, w_high = bootstrap_auroc(y, weak, n=1000, seed=0)
    assert high - low < 0.8 * (w_high - w_low)
    assert paired_bootstrap_delta(y, weak, weak, n=200) == (0.0, 0.0, 0.0)  # a scorer against itself


def test_a_paired_difference_can_hold_each_side_to_its_own_labels():
    """Two runs that labelled the same units differently (a tenth of the labels flipped in the second): the reference
    is scored against its own labels, on the same resampled units as the other side."""
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 2000)
    flipped = np.where(rng.random(2000) < 0.1, 1 - y, y)
    scores = y + rng.normal(0, 1, 2000)
    delta, low, high = paired_bootstrap_delta(y, scores, scores, n=500, seed=0, reference_labels=flipped)
    assert delta == pytest.approx(auroc(y, scores) - auroc(flipped, scores)) and delta > 0.05
    assert low < delta < high and low > 0
    # own labels: the default
    assert paired_bootstrap_delta(y, scores, scores, n=200, reference_labels=y) == (
        0.0,
        0.0,
        0.0,
    )


def test_trigger_rate_by_hand():
    scores = [0.1, 0.5, 0.5, 0.9, 0.2]
    assert trigger_rate(scores, 0.5) == pytest.approx(3 / 5)  # the threshold fires inclusively
    assert trigger_rate(scores, 0.95) == 0.0
    m = binary_metrics([0, 1, 0, 1, 0], scores, 0.5, scores)
    assert m["trigger_rate"] == pytest.approx(3 / 5)


def question_units() -> pd.DataFrame:
    """Validation and test questions where ``good`` separates the labels perfectly and ``noisy`` does not."""
    rows = []
    for split in ("val", "test"):
        for i, (label, good, noisy) in enumerate(
            [(0, 0.1, 0.3), (0, 0.2, 0.9), (0, 0.3, 0.2), (1, 0.7, 0.8), (1, 0.8, 0.1), (1, 0.9, 0.7)]
        ):
            rows.append(
                {"id": f"{split}{i}", "split": split, "status": "ok", "label": label, "good": good, "noisy": noisy}
            )
    rows.append({"id": "failed", "split": "test", "status": "RuntimeError", "label": None, "good": None, "noisy": None})
    return pd.DataFrame(rows)


DETECTOR = ColumnScorer("detector", "noisy", kind="detector", is_probability=True, threshold=0.5)
BASELINES = [ColumnScorer("good", "good"), ColumnScorer("noisy_baseline", "noisy")]


def test_detector_is_compared_with_the_best_baseline_on_the_same_examples():
    results, scores, probabilities = compare(question_units(), [DETECTOR, *BASELINES], "youden", 5, n_bootstrap=200)
    # test AUROCs: good 1.0; noisy: positives 0.8, 0.1, 0.7 beat 2, 0, 2 of the negatives 0.3, 0.9, 0.2 -> 4/9
    assert results["good"]["auroc"] == 1.0 and results["noisy_baseline"]["auroc"] == pytest.approx(4 / 9)
    det = results["detector"]
    assert det["delta_vs"] == "good" and det["delta_auroc"] == pytest.approx(4 / 9 - 1)
    assert det["delta_ci_low"] <= det["delta_auroc"] <= det["delta_ci_high"] <= 0
    assert det["trigger_rate"] == pytest.approx(3 / 6)  # test scores >= 0.5: 0.9, 0.8, 0.7
    assert "delta_vs" not in results["good"]
    assert list(scores.columns) == ["id", "group", "split", "label", "detector", "good", "noisy_baseline"]
    assert scores["group"].tolist() == scores["id"].tolist()  # a question is its own cluster
    assert "failed" not in set(scores["id"]) and list(probabilities.columns) == ["detector", "good", "noisy_baseline"]
    # its own probabilities, as given
    np.testing.assert_allclose(probabilities["detector"], [0.3, 0.9, 0.2, 0.8, 0.1, 0.7])
    table = long_table({"question": results}, [DETECTOR, *BASELINES], "early")
    assert list(table.columns) == list(COLUMNS) and len(table) == 3
    row = table.set_index("scorer").loc["detector"]
    assert (row["kind"], row["dataset"], row["level"], row["features"]) == ("detector", "early", "question", "noisy")
    assert table.set_index("scorer").loc["good", ["delta_auroc", "delta_vs"]].isna().all()


def test_a_scorer_missing_scores_is_a_clear_error():
    units = question_units()
    units.loc[units["id"] == "test4", "noisy"] = np.nan  # e.g. a score table that lacks this id
    with pytest.raises(
        MissingScoresError, match=r"'noisy_baseline' has no score for 1 of 12 units \(e.g. \['test4'\]\)"
    ):
        compare(units, BASELINES, "youden", 5, n_bootstrap=200)


def test_markdown_table_sorts_by_auroc_and_gives_intervals_and_paired_differences():
    results, _, _ = compare(question_units(), [DETECTOR, *BASELINES], "youden", 5, n_bootstrap=200)
    table = long_table({"question": results}, [DETECTOR, *BASELINES], "early")
    text = markdown_table(table)
    assert "## early · question (test: 6 units, 50% hallucinated)" in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and "AUROC" not in line and "---" not in line]
    # the trained detectors first, then the baselines by AUROC
    assert [line.split(" | ")[0] for line in lines[:3]] == [
        "| detector",
        "| good",
        "| noisy_baseline",
    ]
    assert "| good | baseline | 1.000 [1.00, 1.00] | 1.000 |" in text
    d = results["detector"]
    assert (
        f"| detector | good | {d['delta_auroc']:+.3f} [{d['delta_ci_low']:+.2f}, {d['delta_ci_high']:+.2f}] |" in text
    )
    nested = nested_metrics(table, "early")
    assert set(nested) == {"question"} and set(nested["question"]) == {"detector", "good", "noisy_baseline"}
    assert "delta_vs" not in nested["question"]["good"] and nested["question"]["detector"]["delta_vs"] == "good"
    json.dumps(nested, allow_nan=False)  # no NaN in the dvc metrics file


@dataclasses.dataclass(frozen=True)
class Ensemble(ColumnScorer):
    """A column scorer with single seeds of its own, as a seed ensemble's scorer carries them."""

    seeds: tuple[ColumnScorer, ...] = ()


def test_trained_baselines_are_apart_and_a_seed_ensemble_shows_its_single_seeds():
    """A probe fitted on train is no training-free baseline: the detector's difference is measured against the best
    training-free one, and the table lists it apart. A seed ensemble's row carries its single seeds' test AUROCs."""
    seeds = (ColumnScorer("seed 0", "good", kind="detector"), ColumnScorer("seed 1", "noisy", kind="detector"))
    detector = Ensemble("detector", "noisy", kind="detector", is_probability=True, threshold=0.5, seeds=seeds)
    probe = ColumnScorer("probe", "good", kind="trained baseline")
    scorers = [detector, probe, BASELINES[1]]
    results, _, _ = compare(question_units(), scorers, "youden", 5, n_bootstrap=200)
    assert results["probe"]["auroc"] == 1.0 and "delta_vs" not in results["probe"]
    assert results["detector"]["delta_vs"] == "noisy_baseline"  # the best training-free one, not the probe
    spread = {k: v for k, v in results["detector"].items() if k.startswith("seed")}
    assert spread == {
        "seeds": 2,
        "seed_auroc_min": pytest.approx(4 / 9),  # test AUROCs 1 and 4/9 (see the test above)
        "seed_auroc_max": 1.0,
        "seed_auroc_sd": pytest.approx(np.std([1, 4 / 9], ddof=1)),
    }
    assert not any(k.startswith("seed") for k in results["probe"])
    table = long_table({"question": results}, scorers, "early")
    text = markdown_table(table)
    rows = [line.split(" | ")[:2] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:4] == [["| detector", "detector"], ["| probe", "trained baseline"], ["| noisy_baseline", "baseline"]]
    assert f"| 0.444–1.000 (sd {np.std([1, 4 / 9], ddof=1):.3f}, 2 seeds) |" in text
    assert "| detector | vs best training-free baseline |" in text
    assert nested_metrics(table, "early")["question"]["detector"]["seeds"] == 2


def test_a_scorer_whose_interval_lies_below_half_is_shown_inverted():
    inverse = ColumnScorer("inverse", "good", higher_is_hallucinated=False)  # low score = hallucinated: AUROC 0
    results, _, _ = compare(question_units(), [inverse, *BASELINES], "youden", 5, n_bootstrap=200)
    text = markdown_table(long_table({"question": results}, [inverse, *BASELINES], "early"))
    assert "**Inverted:** `inverse` scores correct units above hallucinated ones (AUROC 0.000 [0.00, 0.00]" in text
    assert "read the other way it separates them with AUROC 1.000" in text
    assert "`noisy_baseline`" not in text  # 4/9, its interval reaches above 0.5: not called inverted


def test_colours_depend_on_the_set_of_scorers_not_on_drawing_order():
    names = ["mlp", "flare", "sit_min", "token_entropy", "gru"]
    colours = scorer_colours(names)
    assert scorer_colours(reversed(names)) == colours
    assert len(set(colours.values())) == len(names)
    assert scorer_colours(names + ["mlp"]) == colours  # a name seen at several levels keeps its colour


def test_reliability_bins_by_hand():
    rel = reliability([0, 0, 1, 1, 1], [0.05, 0.15, 0.12, 0.95, 0.9], bins=10)
    # bins [0, .1): 0.05 (label 0); [.1, .2): 0.15, 0.12 (labels 0, 1); [.9, 1]: 0.95, 0.9 (labels 1, 1)
    assert rel["confidence"].tolist() == pytest.approx([0.05, 0.135, 0.925])
    assert rel["frequency"].tolist() == [0.0, 0.5, 1.0] and rel["count"].tolist() == [1, 2, 2]


def realtime_frame() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "id": "r1",
                "split": "test",
                "status": "ok",
                "label": 1,
                "prob": [0.5, 0.2, 0.9],
                "entropy": [1.0, 2.0, 0.1],
                "token_label": [1, 1, 0],
                "entities": json.dumps([{"tokens": [0, 1], "hallucinated": 1}, {"tokens": [2], "hallucinated": 0}]),
            },
            {
                "id": "r2",
                "split": "test",
                "status": "ok",
                "label": 0,
                "prob": [0.6, 0.9],
                "entropy": [0.3, 0.2],
                "token_label": [-1, 0],
                "entities": json.dumps([{"tokens": [1], "hallucinated": 0}]),
            },
        ]
    )


def test_score_tables_join_by_id_and_list_columns_become_token_stats(tmp_path, caplog):
    pd.DataFrame({"id": ["r2", "r1"], "rind": [[0.0, 0.4], [0.3, 0.1, 0.2]]}).to_parquet(tmp_path / "baselines.parquet")
    with caplog.at_level(logging.INFO):
        frame, joined = join_score_tables(
            realtime_frame(), {"CtrlA": tmp_path / "absent.parquet", "baselines": tmp_path / "baselines.parquet"}
        )
    assert joined == ["rind"] and "no CtrlA scores at" in caplog.text
    stats = realtime_token_stats(frame, None, joined)
    np.testing.assert_allclose(stats["r1"]["rind"], [0.3, 0.1, 0.2])
    units = realtime_units(frame, stats)
    # tokens are resampled with their continuation
    assert units[Level.TOKEN]["group"].tolist() == [
        "r1",
        "r1",
        "r1",
        "r2",
    ]
    assert units[Level.ENTITY]["group"].tolist() == ["r1", "r1", "r2"]
    assert "rind" not in [s.name for s in realtime_baselines(Level.TOKEN, {"prob", "entropy"})]
    ctrla = realtime_baselines(Level.TOKEN, {"prob", "entropy", "ctrla_confidence", "ctrla_confidence[val]"})
    assert [s.name for s in ctrla][-2:] == ["ctrla_confidence", "ctrla_confidence[val]"]  # one scorer per CtrlA column


def test_bad_score_tables_are_refused_with_what_to_do(tmp_path):
    pd.DataFrame({"id": ["r1"], "prob": [[0.1]]}).to_parquet(tmp_path / "clash.parquet")
    with pytest.raises(ValueError, match=r"repeat columns \['prob'\]"):
        join_score_tables(realtime_frame(), {"baselines": tmp_path / "clash.parquet"})
    pd.DataFrame({"id": ["r1", "r2"], "rind": [[0.1], [0.2, 0.3]]}).to_parquet(tmp_path / "short.parquet")
    frame, joined = join_score_tables(realtime_frame(), {"baselines": tmp_path / "short.parquet"})
    with pytest.raises(ValueError, match=r"record 'r1': column 'rind' holds 1 values for 3 generated tokens; rerun"):
        realtime_token_stats(frame, None, joined)


def test_too_few_bootstrap_resamples_are_refused():
    with pytest.raises(ParamsError, match="evaluate.bootstrap"):
        EvaluateParams(ece_bins=10, bootstrap=20, seed=0, experiment="x").check("evaluate")
