"""The rule every validation choice follows: a fixed default, left only for a candidate whose paired interval of the
difference lies above 0, on hand-made scores and outcomes."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.evaluation.choice import (
    auroc_deltas,
    choice_tags,
    choose,
    family_level,
    mean_deltas,
    scored_units,
    versus,
)


def scorers(n: int = 400, seed: int = 3):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    default = labels + rng.normal(0, 1.5, n)  # AUROC about 0.68
    return labels, {
        "default": default,
        "sharper": labels + rng.normal(0, 0.5, n),  # about 0.84: surely better
        "nudged": labels + rng.normal(0, 1.45, n),  # as good, its own noise: +0.046 on these units, [-0.03, +0.12]
        "blurred": labels + rng.normal(0, 4.0, n),  # about 0.59: surely worse
    }


def test_a_candidate_replaces_the_default_only_when_its_paired_interval_is_above_0():
    labels, scores = scorers()
    choice = choose("default", auroc_deltas(labels, scores, "default"), units=len(labels))
    assert choice.chosen == "sharper" and choice.moved
    assert choice.better == ("sharper",) and choice.worse == ("blurred",) and choice.ties == ("nudged",)
    delta, low, high = choice.deltas["sharper"]
    assert 0 < low < delta < high
    record = choice.as_dict()
    assert record["chosen"] == "sharper" and record["units"] == 400 and record["ties"] == ["nudged"]


def test_a_margin_of_noise_size_leaves_the_default():
    labels, scores = scorers()
    nudged = {k: scores[k] for k in ("default", "nudged")}
    deltas = auroc_deltas(labels, nudged, "default")
    assert deltas["nudged"][0] > 0  # higher on these units...
    choice = choose("default", deltas, units=len(labels))
    assert choice.chosen == "default" and not choice.moved and choice.ties == ("nudged",)  # ...but level with it


def test_among_several_better_candidates_the_most_surely_better_wins():
    deltas = {"a": (0.10, 0.01, 0.19), "b": (0.06, 0.03, 0.09), "c": (0.05, -0.01, 0.11)}
    choice = choose("d", deltas, units=300)
    assert choice.chosen == "b" and choice.better == ("b", "a") and choice.ties == ("c",)
    assert choose("d", {"e": (float("nan"),) * 3}, units=0).ties == ("e",)  # no interval: a tie, never a move


def test_outcomes_per_question_decide_the_same_way():
    rng = np.random.default_rng(1)
    never = rng.integers(0, 2, 300).astype(float)
    always = np.maximum(never, rng.random(300) < 0.3)  # fixes about a third of the wrong answers, breaks none
    one_more = never.copy()
    one_more[np.flatnonzero(never == 0)[0]] = 1  # one question of 300 better
    deltas = mean_deltas({"never": never, "always": always, "one more": one_more}, "never")
    assert deltas["one more"][0] == pytest.approx(1 / 300)
    choice = choose("never", deltas, units=300)
    assert choice.chosen == "always" and choice.ties == ("one more",)


def test_among_many_candidates_each_interval_is_wider_so_one_margin_that_would_pass_alone_does_not():
    """Bonferroni: with twenty candidates (every layer window, say) each interval is at 1 - 0.05/20, so a margin that
    clears 0 at 95 % for one candidate stays a tie among twenty."""
    assert family_level(1) == 0.95 and family_level(3) == pytest.approx(1 - 0.05 / 3)
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, 300)
    scores = {"default": labels + rng.normal(0, 1.5, 300), "better": labels + rng.normal(0, 1.0, 300)}
    alone = choose("default", auroc_deltas(labels, scores, "default"), 300)
    level = family_level(20)
    among = choose("default", auroc_deltas(labels, scores, "default", level=level), 300, level)
    (delta, low, high), (same, wide_low, wide_high) = alone.deltas["better"], among.deltas["better"]
    assert delta == same and wide_low < low and high < wide_high  # the same difference, a wider interval
    assert alone.chosen == "better" and among.chosen == "default" and among.ties == ("better",)
    assert among.as_dict()["level"] == level and "99.8 % bootstrap interval" in among.as_dict()["rule"]


def test_two_records_of_the_same_units_are_compared_unit_by_unit():
    labels = np.random.default_rng(2).integers(0, 2, 300)
    noise = np.random.default_rng(3).normal(0, 1, 300)
    ids = [f"q{i}" for i in range(300)]
    old, new = scored_units(ids, labels, labels * 0.3 + noise), scored_units(ids, labels, labels * 3.0 + noise)
    reordered = {k: v[::-1] for k, v in new.items()}  # the order of the units does not matter, their ids do
    choice = versus(old, reordered, ("champion", "new"))
    assert choice.chosen == "new" and choice.units == 300 and choice.deltas["new"][1] > 0
    assert versus(new, old, ("champion", "new")).chosen == "champion"  # the worse one does not move it
    assert versus(old, scored_units([f"x{i}" for i in range(300)], labels, noise)) is None  # other units
    assert versus(old, scored_units(ids, 1 - labels, noise)) is None  # other labels: not the same units
    with pytest.raises(ValueError, match="300 ids, 299 labels and 300 scores"):
        scored_units(ids, labels[:-1], noise)
    tags = choice_tags("rule", choice.as_dict())
    assert tags["rule.chosen"] == "new" and tags["rule.ties"] == "none" and tags["rule.units"] == "300"
    assert choice_tags("rule", None) == {}
