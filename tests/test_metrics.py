"""Metrics shared by every scorer: thresholds, AUROC/AUPRC, accuracy/F1 at a threshold, ECE, Platt."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.evaluation.bootstrap import bootstrap_auroc
from detectors.evaluation.metrics import (
    OneClassError,
    auroc,
    binary_metrics,
    choose_threshold,
    f1_at,
    fit_logistic,
    platt,
    require_both_classes,
)

# Scores 0.1..0.6, labels 0 1 0 1 1 1 (4 positives, 2 negatives).
# Youden J = tpr - fpr at each candidate threshold t (predict 1 when score >= t):
#   t=0.6: 1/4 - 0   = 0.25      t=0.3: 3/4 - 1/2 = 0.25
#   t=0.5: 2/4 - 0   = 0.50      t=0.2: 4/4 - 1/2 = 0.50
#   t=0.4: 3/4 - 0   = 0.75 <-   t=0.1: 4/4 - 2/2 = 0
# F1 = 2 tp / (#predicted + #positives):
#   t=0.6: 2/5   t=0.5: 4/6   t=0.4: 6/7   t=0.3: 6/8   t=0.2: 8/9 <-   t=0.1: 8/10
SCORES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
LABELS = [0, 1, 0, 1, 1, 1]


def test_youden_threshold_matches_hand_computation():
    assert choose_threshold(LABELS, SCORES, "youden") == pytest.approx(0.4)


def test_youden_threshold_second_hand_example():
    # labels 0 0 0 1 0 1: J(0.6)=1/2, J(0.5)=1/2-1/4, J(0.4)=1-1/4=3/4 (max), J(0.3)=1-2/4
    assert choose_threshold([0, 0, 0, 1, 0, 1], SCORES) == pytest.approx(0.4)


def test_f1_threshold_matches_hand_computation():
    assert choose_threshold(LABELS, SCORES, "f1") == pytest.approx(0.2)
    assert f1_at(LABELS, SCORES, 0.2) == pytest.approx(8 / 9)
    assert f1_at(LABELS, SCORES, 0.4) == pytest.approx(6 / 7)


def test_threshold_does_not_depend_on_example_order():
    order = [3, 0, 5, 1, 4, 2]
    labels = [LABELS[i] for i in order]
    scores = [SCORES[i] for i in order]
    assert choose_threshold(labels, scores, "youden") == pytest.approx(0.4)
    assert choose_threshold(labels, scores, "f1") == pytest.approx(0.2)


def test_unknown_threshold_strategy_is_refused():
    with pytest.raises(ValueError, match="median"):
        choose_threshold(LABELS, SCORES, "median")


@pytest.mark.parametrize("labels", [[0, 0, 0, 0], [1, 1, 1, 1]])
def test_one_class_labels_raise_a_helpful_error(labels):
    scores = [0.1, 0.4, 0.6, 0.9]
    with pytest.raises(OneClassError, match="only one class") as err:
        choose_threshold(labels, scores)
    message = str(err.value)
    assert "validation" in message
    assert f"{sum(labels)} hallucinated of 4" in message
    assert "qa.limit" in message  # tells the user what to change
    with pytest.raises(OneClassError, match="evaluated split"):
        binary_metrics(labels, scores, 0.5, scores)


def test_require_both_classes_accepts_a_mixed_split():
    require_both_classes(np.array([0, 1, 0]), "the test split")  # does not raise
    with pytest.raises(OneClassError, match="the test split"):
        require_both_classes(np.array([1, 1]), "the test split")


def test_perfectly_separating_scores_have_auroc_and_auprc_one():
    labels = [0, 0, 0, 1, 1, 1]
    scores = [0.05, 0.1, 0.3, 0.6, 0.8, 0.95]
    m = binary_metrics(labels, scores, 0.5, scores)
    assert m["auroc"] == pytest.approx(1.0)
    assert m["auprc"] == pytest.approx(1.0)
    assert m["accuracy"] == pytest.approx(1.0)
    assert m["f1"] == pytest.approx(1.0)


def test_reversed_scores_have_auroc_zero():
    labels = [0, 0, 0, 1, 1, 1]
    scores = [0.95, 0.8, 0.6, 0.3, 0.1, 0.05]
    m = binary_metrics(labels, scores, 0.5, scores)
    assert m["auroc"] == pytest.approx(0.0)
    assert m["accuracy"] == pytest.approx(0.0)
    assert m["f1"] == pytest.approx(0.0)


def test_accuracy_f1_and_auroc_at_a_threshold_by_hand():
    labels = [1, 0, 1, 1, 0, 0]
    scores = [0.9, 0.8, 0.7, 0.3, 0.2, 0.1]
    # threshold 0.5 predicts 1 1 1 0 0 0: TP=2 FP=1 FN=1 TN=2
    m = binary_metrics(labels, scores, 0.5, scores)
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    # pairs (pos, neg) ranked correctly: 0.9 beats 3, 0.7 beats 2, 0.3 beats 2 -> 7 of 9
    assert m["auroc"] == pytest.approx(7 / 9)
    assert m["threshold"] == 0.5
    assert m["n"] == 6
    assert m["positive_rate"] == pytest.approx(0.5)
    # the threshold is inclusive: at 0.3 the fourth example is predicted 1 -> TP=3 FP=1 TN=2
    m = binary_metrics(labels, scores, 0.3, scores)
    assert m["accuracy"] == pytest.approx(5 / 6)
    assert m["f1"] == pytest.approx(6 / 7)


def test_ece_is_zero_for_probabilities_calibrated_within_bins():
    # bin 0.25 holds 1 positive of 4, bin 0.75 holds 3 positives of 4
    probs = np.array([0.25] * 4 + [0.75] * 4)
    labels = np.array([1, 0, 0, 0, 1, 1, 1, 0])
    m = binary_metrics(labels, probs, 0.5, probs, ece_bins=10)
    assert m["ece"] == pytest.approx(0.0, abs=1e-6)


def test_ece_is_large_for_confident_wrong_probabilities():
    probs = np.array([0.95] * 4 + [0.05] * 4)
    labels = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    m = binary_metrics(labels, probs, 0.5, probs, ece_bins=10)
    assert m["ece"] == pytest.approx(0.95, abs=1e-6)


VAL_LABELS = [0, 0, 1, 0, 1, 1, 0, 1]  # overlapping classes: the logistic fit is finite
VAL_SCORES = [0.1, 0.2, 0.3, 0.35, 0.5, 0.6, 0.65, 0.9]
GRID = np.linspace(-1.0, 2.0, 13)


def test_platt_is_increasing_when_higher_scores_mean_hallucinated():
    prob = platt(VAL_LABELS, VAL_SCORES)(GRID)
    assert prob.shape == GRID.shape
    assert np.all(np.diff(prob) > 0)
    assert np.all((prob > 0) & (prob < 1))
    # the fit follows the data: low validation scores are mostly 0, high ones mostly 1
    assert prob[0] < 0.1 < 0.9 < prob[-1]


def test_platt_is_decreasing_when_scores_are_reversed():
    prob = platt(VAL_LABELS, [-s for s in VAL_SCORES])(GRID)
    assert np.all(np.diff(prob) < 0)
    assert np.all((prob > 0) & (prob < 1))


def test_platt_probabilities_stay_in_open_interval_on_validation_range():
    fn = platt(VAL_LABELS, VAL_SCORES)
    prob = fn(np.array(VAL_SCORES))
    assert np.all((prob > 0) & (prob < 1))
    # mean predicted probability is close to the positive rate (logistic regression with intercept)
    assert float(prob.mean()) == pytest.approx(np.mean(VAL_LABELS), abs=0.02)


def test_platt_on_separable_validation_data_still_gives_open_interval_probabilities():
    fn = platt([0, 0, 0, 1, 1, 1], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    prob = fn(np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    assert np.all(np.diff(prob) >= 0)
    assert np.all((prob > 0) & (prob < 1))


@pytest.mark.parametrize(
    "scores, expected",
    [
        ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 4.0),  # e.g. an entropy baseline
        ([-0.9, -0.8, -0.7, -0.3, -0.2, -0.1], -0.3),  # e.g. the negated first_token_prob baseline
    ],
)
def test_youden_threshold_is_in_the_units_of_raw_scores(scores, expected):
    labels = [0, 0, 0, 1, 1, 1]
    threshold = choose_threshold(labels, scores, "youden")
    # the threshold must separate the raw scores it was chosen on
    assert binary_metrics(labels, scores, threshold, [0.5] * 6)["accuracy"] == pytest.approx(1.0)
    assert threshold == pytest.approx(expected)


def test_auroc_of_large_raw_scores_that_separate_perfectly_is_one():
    labels = [0, 0, 0, 1, 1, 1]
    scores = [40.0, 41.0, 42.0, 43.0, 44.0, 45.0]
    m = binary_metrics(labels, scores, 42.5, [0.5] * 6)
    assert m["accuracy"] == pytest.approx(1.0)  # raw-score comparison is right
    assert m["auroc"] == pytest.approx(1.0)
    assert m["auprc"] == pytest.approx(1.0)


def test_logistic_regression_learns_the_informative_feature():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    x = np.c_[y + rng.normal(0, 0.5, 400), rng.normal(0, 1, 400)]  # first column informative, second noise
    model = fit_logistic(x[:300], y[:300])
    p = model(x[300:])
    assert ((p > 0) & (p < 1)).all()
    assert auroc(y[300:], p) > 0.9
    assert model(np.array([[2.0, 0.0]]))[0] > 0.9 > 0.1 > model(np.array([[-1.0, 0.0]]))[0]


def test_bootstrap_interval_brackets_the_auroc_and_shrinks_with_data():
    rng = np.random.default_rng(1)
    widths = []
    for n in (60, 600):
        y = rng.integers(0, 2, n)
        s = y + rng.normal(0, 1.2, n)
        low, high = bootstrap_auroc(y, s)
        assert low <= auroc(y, s) <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2
