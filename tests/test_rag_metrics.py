"""The RAG evaluation without the loop: answer metrics, accuracy vs retrieval-rate curves, the Markdown table, MLflow
runs, the rag_eval params section and the stage's resumable run files, on hand-made results."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import math
import re

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import ROOT
from mlflow.entities import ViewType

from detectors.config import ParamsError, load_section
from detectors.config.rag import references
from detectors.errors import InputError
from detectors.evaluation.answer_metrics import (
    FAILED,
    METRICS,
    accuracy,
    answer_recall,
    exact_match,
    summarise,
    token_f1,
)
from detectors.evaluation.rag_metrics import check_failures, other_template, reference_deltas, versus_always
from detectors.evaluation.rag_report import curves_table, markdown_table, write_curves, write_prompts
from detectors.evaluation.rag_sweep import (
    Outcome,
    candidate_names,
    candidate_thresholds,
    curve,
    curves,
    question_outcomes,
    records,
    sweep_line,
    trace_events,
)
from detectors.evaluation.rag_tracking import log_rag_runs
from detectors.evaluation.rag_tuning import choose_candidates, tuning_candidates
from detectors.extensions import FRAMEWORKS, QUERIES, TRAINING_FREE
from detectors.rag.experiment import split_questions
from detectors.rag.systems import Run, System, run_questions
from detectors.registry import store


def result(
    answer: str,
    retrievals: list[list[str]] = (),
    error: str | None = None,
    passes: int = 10,
    tokens: int = 4,
    wall: float = 0.5,
) -> dict:
    """A stored RagResult (``dataclasses.asdict`` shape) with one retrieval per passage list."""
    rets = [
        {
            "trigger": "flare",
            "position": 0,
            "score": 0.9,
            "queries": ["q"],
            "passage_ids": [str(i) for i in range(len(p))],
            "passages": p,
        }
        for p in retrievals
    ]
    return {
        "question": "q",
        "answer": answer,
        "retrievals": rets,
        "forward_passes": passes,
        "generated_tokens": tokens,
        "wall_s": wall,
        "prompts": [],
        "error": error,
    }


# ---- metrics ----------------------------------------------------------------------------------------------------


def test_exact_match_and_token_f1_are_squads_over_the_best_reference():
    assert exact_match("The Eiffel Tower!", ["Louvre", "eiffel tower"]) == 1.0
    assert exact_match("Eiffel Tower in Paris", ["Eiffel Tower"]) == 0.0
    assert token_f1("Paris, France", ["Paris"]) == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("Paris, France", ["Lyon", "France Paris"]) == 1.0  # bag of words, best reference
    assert token_f1("Rome", ["Paris"]) == 0.0
    assert token_f1("the", ["Paris"]) == 0.0  # normalised to nothing
    assert token_f1("Paris", []) == 0.0


def test_accuracy_and_answer_recall_are_whole_word_containment():
    assert accuracy("He was born in Paris in 1900", ["paris"]) == 1.0
    assert accuracy("He was born in Parisville", ["Paris"]) == 0.0
    assert answer_recall(["Lyon is a city.", "Paris is the capital of France."], ["paris"]) is True
    assert answer_recall(["Lyon is a city."], ["paris"]) is False
    assert answer_recall([], ["paris"]) is False


def test_summarise_gives_every_metric_of_one_configuration():
    # right, 2 retrievals, 1 recalled
    results = [
        result("Paris", [["Lyon"], ["Paris is in France"]], passes=12, tokens=6, wall=1.0),
        result("Rome", [["nothing here"]], error="no passage retrieved", passes=8, tokens=2, wall=0.5),
        result("Berlin, Germany", passes=4, tokens=4, wall=0.0),
    ]
    m = summarise(results, [["Paris"], ["Madrid"], ["Berlin"]])
    assert set(m) == set(METRICS)
    assert m["em"] == pytest.approx(1 / 3) and m["accuracy"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx((1 + 0 + 2 * 0.5 / 1.5) / 3)
    assert m["retrievals_per_question"] == 1.0 and m["trigger_rate"] == pytest.approx(2 / 3)
    assert m["answer_recall_at_k"] == pytest.approx(1 / 3)  # 3 retrievals, one holds a reference
    assert (m["forward_passes_per_question"], m["generated_tokens_per_question"], m["wall_s_per_question"]) == (
        8.0,
        4.0,
        0.5,
    )
    assert (m["n"], m["failed"], m["no_passage"]) == (3, 0, 1)  # nothing retrieved is an outcome, not a failure
    assert summarise([result("x")], [["y"]])["answer_recall_at_k"] is None  # nothing retrieved: no recall, not 0


def test_summarise_refuses_mismatched_or_incomplete_results():
    with pytest.raises(ValueError, match="2 results but 1 reference"):
        summarise([result("a"), result("b")], [["a"]])
    broken = result("a")
    del broken["wall_s"]
    with pytest.raises(ValueError, match=r"lacks keys \['wall_s'\]"):
        summarise([broken], [["a"]])
    with pytest.raises(ValueError, match="no results"):
        summarise([], [])


# ---- accuracy vs retrieval rate ------------------------------------------------------------------------------------


def needs(score: float, needed: bool) -> Outcome:
    """An early-trigger question: right after retrieval; right without it unless it ``needed`` retrieval."""
    return Outcome([(score, 0)], never=not needed, at={0: True})


def test_a_perfect_trigger_reaches_always_accuracy_at_the_share_of_questions_that_need_retrieval():
    c = curve("perfect", [needs(0.9, True)] * 4 + [needs(0.1, False)] * 6)
    assert c.threshold.tolist() == [np.inf, 0.9, 0.1]
    assert c.retrieval_rate.tolist() == [0.0, 0.4, 1.0] and c.accuracy.tolist() == pytest.approx([0.6, 1.0, 1.0])
    assert (c.never_accuracy, c.always_accuracy) == (pytest.approx(0.6), 1.0)
    assert c.rate_to_always == 0.4
    assert c.area == pytest.approx(0.4 * (0.6 + 1.0) / 2 + 0.6 * 1.0)
    assert c.random_area == pytest.approx(0.8) and c.area > c.random_area


def test_a_reversed_trigger_is_below_random():
    c = curve("reversed", [needs(0.1, True)] * 4 + [needs(0.9, False)] * 6)
    assert c.retrieval_rate.tolist() == [0.0, 0.6, 1.0] and c.accuracy.tolist() == pytest.approx([0.6, 0.6, 1.0])
    assert c.area == pytest.approx(0.6 * 0.6 + 0.4 * 0.8) and c.area < c.random_area
    assert c.rate_to_always == 1.0


def test_tied_scores_change_together_whatever_the_order_of_the_questions():
    outcomes = [needs(0.5, True), needs(0.5, False), needs(0.7, True), needs(0.2, False)]
    c = curve("tie", outcomes)
    assert c.threshold.tolist() == [np.inf, 0.7, 0.5, 0.2]  # one point for the two questions scored 0.5
    assert c.retrieval_rate.tolist() == [0.0, 0.25, 0.75, 1.0]
    assert c.accuracy.tolist() == pytest.approx([0.5, 0.75, 1.0, 1.0])
    for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
        other = curve("tie", [outcomes[i] for i in order])
        assert (
            other.retrieval_rate.tolist() == c.retrieval_rate.tolist()
            and other.accuracy.tolist() == c.accuracy.tolist()
        )
        assert other.area == c.area


def test_a_token_trigger_moves_its_retrieval_earlier_as_the_threshold_falls():
    # the late crossing (position 2) keeps a wrong prefix; the early one (position 0) fixes the answer
    q = Outcome([(0.3, 0), (0.8, 2)], never=False, at={0: True, 2: False})
    c = curve("token", [q, Outcome([(0.5, 1)], never=True, at={0: True, 1: True})])
    assert c.threshold.tolist() == [np.inf, 0.8, 0.5, 0.3]
    assert c.retrieval_rate.tolist() == [0.0, 0.5, 1.0, 1.0]  # the last threshold only moves a retrieval earlier
    assert c.accuracy.tolist() == pytest.approx([0.5, 0.5, 0.5, 1.0])
    assert c.area == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)  # the vertical step adds no area
    assert c.rate_to_always == 1.0


def test_questions_a_trigger_cannot_reach_close_the_curve_as_random_retrieval_would():
    c = curve("empty answer", [needs(0.5, True), Outcome([], never=False, at={0: True})])
    assert c.retrieval_rate.tolist() == [0.0, 0.5] and c.accuracy.tolist() == [0.0, 0.5]
    assert c.area == pytest.approx(0.5 * 0.25 + 0.5 * 0.75)  # straight on to (1, always accuracy)
    assert c.area == pytest.approx(c.random_area) and c.rate_to_always == 1.0


def test_records_are_the_running_max_and_outcomes_are_checked():
    assert records([0.2, 0.1, 0.5, 0.5, np.nan, 0.7]) == [(0.2, 0), (0.5, 2), (0.7, 5)]
    assert records([0.2, 0.9, 0.1], truncate="segment") == [(0.9, 0)]
    assert records([np.nan]) == [] and records([]) == []
    with pytest.raises(ValueError, match="lacks position 0"):
        Outcome([(0.5, 1)], never=True, at={1: True})
    with pytest.raises(ValueError, match=r"lacks the correctness at positions \[3\]"):
        Outcome([(0.5, 3)], never=True, at={0: True})
    with pytest.raises(ValueError, match="not records of a running max"):
        Outcome([(0.5, 0), (0.4, 2)], never=True, at={0: True, 2: True})


def test_stored_sweep_lines_give_each_triggers_curve():
    class Trace:  # what question_trace returns, by hand
        question_scores = {"dior-early": 0.6}
        token_scores = {"flare": np.array([0.1, 0.4, 0.3]), "ctrla": np.array([0.2, 0.9])}
        truncate = {"flare": "token", "ctrla": "segment"}

    events = trace_events(Trace())
    assert events == {"dior-early": [(0.6, 0)], "flare": [(0.1, 0), (0.4, 1)], "ctrla": [(0.9, 0)]}
    line = json.loads(json.dumps(sweep_line(events, "Rome", {0: "Paris", 1: "Rome, Paris"}, ["Paris"])))
    assert line["never"] is False and line["at"] == {"0": True, "1": True}
    out = curves([line], ["dior-early", "flare"])
    assert out["flare"].retrieval_rate.tolist() == [0.0, 1.0, 1.0] and out["flare"].accuracy.tolist() == [0.0, 1.0, 1.0]
    assert out["dior-early"].rate_to_always == 1.0


def test_paired_intervals_compare_each_configuration_with_the_references_on_the_same_questions():
    refs = {f"q{i}": ["Rome"] for i in range(20)}
    answers = {
        "no-retrieval": ["Rome"] * 10 + ["x"] * 10,
        "single-round": ["Rome"] * 16 + ["x"] * 4,
        "one-more": ["Rome"] * 11 + ["x"] * 9,
        "reversed": ["x"] * 10 + ["Rome"] * 10,
    }
    results = {name: [{**result(a), "id": f"q{i}"} for i, a in enumerate(values)] for name, values in answers.items()}
    deltas = reference_deltas(results, refs, {"never": "no-retrieval", "always": "single-round"}, n=500, seed=1)
    assert deltas["no-retrieval"]["accuracy_vs_never"] == 0 and deltas["no-retrieval"]["accuracy_vs_never_ci_low"] == 0
    assert deltas["single-round"]["accuracy_vs_never"] == pytest.approx(0.3) and deltas["no-retrieval"][
        "accuracy_vs_always"
    ] == pytest.approx(-0.3)
    # paired: one question better and none worse never resamples below 0 (an unpaired interval would)
    one = deltas["one-more"]
    assert (
        one["accuracy_vs_never"] == pytest.approx(0.05)
        and one["accuracy_vs_never_ci_low"] == 0
        and 0 < one["accuracy_vs_never_ci_high"] <= 0.15
    )
    # the same accuracy on other questions: a zero difference with a wide interval
    rev = deltas["reversed"]
    assert (
        rev["accuracy_vs_never"] == 0
        and rev["accuracy_vs_never_ci_low"] < -0.2
        and rev["accuracy_vs_never_ci_high"] > 0.2
    )
    # a reference that did not run: no difference
    assert reference_deltas(results, refs, {"never": "absent"})["one-more"] == {}
    # a framework that answered a sample of the questions is compared on those questions only; a row with `versus` with
    # that row
    results["sampled"] = [r for r in results["reversed"] if r["id"] in {f"q{i}" for i in range(10, 20)}]
    paired = reference_deltas(
        results, refs, {"never": "no-retrieval"}, n=500, seed=1, versus={"one-more": "single-round"}
    )
    assert paired["sampled"]["accuracy_vs_never"] == pytest.approx(1.0)  # right on all 10, where no retrieval is wrong
    assert paired["one-more"]["versus"] == "single-round"
    assert paired["one-more"]["accuracy_vs_versus"] == pytest.approx(-0.25) and "versus" not in paired["reversed"]


def test_the_references_are_the_configurations_that_never_and_always_retrieve():
    section = load_section("rag_eval", data=rag_params())
    assert references(section.configurations) == {"never": "no-retrieval", "always": "single-round"}


def test_a_configuration_with_its_own_template_is_not_compared_with_always_retrieving():
    section = load_section("rag_eval", data=rag_params())
    assert other_template(section.configurations, section.context, "single-round") == []  # one template for all
    data = rag_params()
    data["rag_eval"]["configurations"]["dior"]["context"] = "{passages}\nAnswer from the passages above.\n"
    section = load_section("rag_eval", data=data)
    assert other_template(section.configurations, section.context, "single-round") == ["dior"]
    assert other_template(section.configurations, section.context, None) == []


# ---- operating points: each configuration's own procedure on the validation questions ---------------------------


def val_curve(scores, never, with_passages):
    return curve("t", question_outcomes(scores, never, with_passages))


def test_a_configurations_candidates_are_never_always_its_curves_best_point_and_the_points_nearest_the_rates():
    # four questions; retrieval helps the first two; scores rank them 0.9 > 0.7 > 0.5 > 0.2
    c = val_curve([0.9, 0.7, 0.5, 0.2], [False, False, True, True], [True, True, False, True])
    assert list(c.retrieval_rate) == [0, 0.25, 0.5, 0.75, 1.0]
    never, always = math.inf, -math.inf  # every configuration's two defaults come first
    assert candidate_thresholds(c, [0.3, 0.7]) == [never, always, 0.7, 0.9, 0.5]  # the best point (2 of 4), then
    # rates 0.25 and 0.75
    assert candidate_thresholds(c, [0.375]) == [never, always, 0.7, 0.9]  # equally near 0.25 and 0.5: the higher one
    assert candidate_names([0.3, 0.7]) == ["never", "always", "best", "rate 0.3", "rate 0.7"]


def test_each_configuration_is_tried_at_its_triggers_candidates_together_and_fixed_thresholds_stay():
    section = load_section("rag_eval", data=rag_params())
    curves_ = {
        "a": val_curve([0.9, 0.7, 0.5, 0.2], [False, False, True, True], [True, True, False, True]),
        "b": val_curve([0.8, 0.6, 0.4, 0.1], [True, True, True, True], [False, False, False, False]),
    }
    configs = {
        name: section.configurations["flare"].__class__(**{**section.configurations["flare"].__dict__, "triggers": t})
        for name, t in {"none": [], "always": ["always"], "one": ["a"], "two": ["a", "b@champion"]}.items()
    }
    got = tuning_candidates(configs, "wiki", curves_, {}, [0.3, 0.7])
    nothing = [{"label": "no threshold", "thresholds": {}}]
    assert got["none"] == nothing and got["always"] == nothing  # nothing to choose: one run
    inf = math.inf
    assert got["one"] == [
        {"label": "never", "thresholds": {"a": inf}},
        {"label": "always", "thresholds": {"a": -inf}},
        {"label": "best", "thresholds": {"a": 0.7}},
        {"label": "rate 0.3", "thresholds": {"a": 0.9}},
        {"label": "rate 0.7", "thresholds": {"a": 0.5}},
    ]
    # b never helps: its best point never retrieves
    assert [c["thresholds"] for c in got["two"]] == [
        {"a": inf, "b": inf},
        {"a": -inf, "b": -inf},
        {"a": 0.7, "b": inf},
        {"a": 0.9, "b": 0.8},
        {"a": 0.5, "b": 0.4},
    ]
    # fixed in params: tried once
    assert tuning_candidates(configs, "wiki", curves_, {"a": 0.1}, [0.3, 0.7])["one"] == [
        {"label": "fixed", "thresholds": {"a": 0.1}}
    ]
    own = {"one": dataclasses.replace(configs["one"], thresholds={"a": -inf})}
    # fixed in the configuration's own row
    assert tuning_candidates(own, "wiki", curves_, {}, [0.3])["one"] == [{"label": "fixed", "thresholds": {"a": -inf}}]
    repeated = tuning_candidates({"one": configs["one"]}, "wiki", {"a": val_curve([0.9], [True], [False])}, {}, [0.0])
    assert [c["label"] for c in repeated["one"]] == ["never", "always"]  # best and rate 0 repeat never: tried once


def tuning_line(answer: str, n: int) -> dict:
    return {
        "answer": answer,
        "retrievals": [{"passages": [], "queries": ["q"]}] * n,
        "forward_passes": 1,
        "generated_tokens": 1,
        "wall_s": 0.1,
        "error": None,
    }


def test_a_configuration_leaves_the_better_of_never_and_always_only_for_a_surely_better_candidate():
    """The one rule of choices (detectors.evaluation.choice): never retrieving is the default unless always retrieving
    is surely better (its paired 95% interval above 0); a candidate replaces the default only when its own paired
    interval over it lies above 0; a candidate one question ahead is a tie, and the default stays."""
    answers = [["x"]] * 40
    right = lambda k: [tuning_line("x" if i < k else "no", 1) for i in range(40)]  # noqa: E731 - the first k right
    candidates = {
        "c": [
            {"label": label, "thresholds": {"t": t}}
            for label, t in [("never", math.inf), ("always", -math.inf), ("best", 0.5), ("rate 0.3", 0.7)]
        ]
    }
    lines = {"c/0": right(20), "c/1": right(30), "c/2": right(31), "c/3": right(21)}
    got = choose_candidates(candidates, lines, answers, bootstrap=500)["c"]
    assert (got["default"], got["chosen"], got["thresholds"]) == (1, 1, {"t": -math.inf})  # always: 10 more right
    assert got["choice"]["ties"] == ["best"] and got["choice"]["worse"] == ["never", "rate 0.3"]
    assert [c["accuracy"] for c in got["candidates"]] == [0.5, 0.75, 0.775, 0.525]
    assert got["candidates"][2]["delta"][0] == pytest.approx(0.025) and got["candidates"][2]["delta"][1] == 0
    lines["c/1"] = right(21)  # always one question ahead of never: a tie goes to fewer retrievals
    got = choose_candidates(candidates, lines, answers, bootstrap=500)["c"]
    assert (got["default"], got["chosen"]) == (0, 2)  # never, left for best: 11 more right, surely better
    assert got["choice"]["better"] == ["best"] and got["choice"]["units"] == 40
    lines["c/2"] = right(22)
    assert choose_candidates(candidates, lines, answers, bootstrap=500)["c"]["chosen"] == 0  # nothing surely better
    single = choose_candidates({"s": [{"label": "no threshold", "thresholds": {}}]}, {"s/0": right(3)}, answers)["s"]
    assert (single["chosen"], single["candidates"][0]["accuracy"]) == (0, 0.075)


def test_a_curves_area_over_random_has_a_bootstrap_interval():
    lines = [
        sweep_line({"t": [(0.9, 0)] if needed else [(0.1, 0)]}, "x", {0: "Rome" if needed else "x"}, ["Rome"])
        for needed in [True, False] * 10
    ]
    (c,) = curves(lines, ["t"], bootstrap=300, seed=0).values()
    assert c.area - c.random_area == pytest.approx(0.125)  # a perfect trigger: 0.375 against 0.25
    low, high = c.interval
    assert 0 < low <= 0.125 <= high
    assert np.isnan(curves(lines, ["t"])["t"].interval[0])  # none without resamples


def test_a_trained_triggers_area_is_compared_with_the_best_training_free_ones_on_the_same_questions():
    # "perfect" ranks the questions that need retrieval first; "half" only half of them; "blind" none
    lines = []
    for i, needed in enumerate([True, False] * 10):
        events = {
            "perfect": [(0.9 if needed else 0.1, 0)],
            "half": [(0.9 if needed and i % 4 == 0 else 0.5, 0)],
            "blind": [(0.5, 0)],
        }
        lines.append(sweep_line(events, "x", {0: "Rome" if needed else "x"}, ["Rome"]))
    out = curves(
        lines,
        ["perfect", "half", "blind"],
        bootstrap=300,
        seed=0,
        kinds={"perfect": "detector", "half": "baseline", "blind": "baseline"},
    )
    assert (
        out["perfect"].best_free == out["blind"].best_free == out["half"].best_free == "half"
        and out["half"].over_best_free == 0
    )
    assert (
        out["perfect"].over_best_free == pytest.approx(out["perfect"].area - out["half"].area)
        and out["perfect"].over_best_free > 0
    )
    low, high = out["perfect"].over_best_free_interval
    assert 0 <= low <= out["perfect"].over_best_free <= high  # paired: never worse on a resample
    assert out["perfect"].summary()["best_training_free"] == "half"


def test_against_always_a_configuration_saves_retrievals_at_its_accuracy_or_loses_accuracy():
    configs = {
        "single-round": {"accuracy": 0.80, "retrievals_per_question": 1.0},
        "thrifty": {"accuracy": 0.81, "retrievals_per_question": 0.7},
        "eager": {"accuracy": 0.92, "retrievals_per_question": 3.0},
        "lossy": {"accuracy": 0.78, "retrievals_per_question": 0.5},
    }
    trade = versus_always(configs, "single-round")
    assert trade["single-round"] == {"retrievals_saved_vs_always": 0.0}
    assert trade["thrifty"]["retrievals_saved_vs_always"] == pytest.approx(0.3) and trade["eager"][
        "retrievals_saved_vs_always"
    ] == pytest.approx(-2.0)
    assert trade["lossy"] == {"accuracy_lost_vs_always": pytest.approx(0.02)}
    assert versus_always(configs, "absent") == {name: {} for name in configs}
    md = markdown_table({"facts": {name: {**metrics_of(0.5), **configs[name], **trade[name]} for name in configs}})
    assert "| saves 0% | saves 30% | 3.0× the retrievals | loses 0.020 |" in md


# ---- report and MLflow ---------------------------------------------------------------------------------------------


def metrics_of(em: float, recall: float | None = 0.5) -> dict:
    return {
        "em": em,
        "f1": em + 0.1,
        "accuracy": em + 0.2,
        "retrievals_per_question": 1.0,
        "searches_per_question": 2.0,
        "trigger_rate": 0.5,
        "forward_passes_per_question": 12.0,
        "generated_tokens_per_question": 6.0,
        "wall_s_per_question": 0.25,
        "answer_recall_at_k": recall,
        "n": 10,
        "failed": 0,
        "no_passage": 0,
    }


METRICS_BY_CORPUS = {
    "wiki": {"no-retrieval": metrics_of(0.2, None), "flare": metrics_of(0.3)},
    "facts": {"no-retrieval": metrics_of(0.2, None), "flare": metrics_of(0.2)},
}
SWEEP = {
    "corpus": "facts",
    "query": "question",
    "curves": {"flare": curve("flare", [needs(0.9, True), needs(0.1, False)]).summary()},
}


def test_markdown_table_has_a_block_per_corpus_and_the_best_in_bold():
    assert "Acc − no retrieval" not in markdown_table(METRICS_BY_CORPUS)  # no row without differences
    with_deltas = {
        corpus: {
            name: {
                **m,
                "accuracy_vs_never": 0.1 if name == "flare" else 0.0,
                "accuracy_vs_never_ci_low": -0.02,
                "accuracy_vs_never_ci_high": 0.21,
            }
            for name, m in configs.items()
        }
        for corpus, configs in METRICS_BY_CORPUS.items()
    }
    assert "| Acc − no retrieval [95% CI] | +0.000 [-0.020, +0.210] | +0.100 [-0.020, +0.210] |" in markdown_table(
        with_deltas
    )
    md = markdown_table(METRICS_BY_CORPUS)
    wiki, facts = md.split("### corpus `facts`")
    assert "| metric | no-retrieval | flare |" in wiki
    assert "| EM | 0.200 | **0.300** |" in wiki and "| Acc (containment) | 0.400 | **0.500** |" in wiki
    assert "| EM | **0.200** | **0.200** |" in facts  # ties: both in bold
    assert "| answer recall@k | – | 0.500 |" in wiki and "| questions | 10 | 10 |" in wiki
    assert "| retrievals / question | 1.00 | 1.00 |" in wiki and "| searches / question | 2.00 | 2.00 |" in wiki
    # a row that isolates a step against another; a framework on a sample of the questions says so
    sampled = copy.deepcopy(METRICS_BY_CORPUS)
    sampled["wiki"]["retrorag"] = {**metrics_of(0.1), "n": 4}
    sampled["wiki"]["flare"] |= {
        "versus": "no-retrieval",
        "accuracy_vs_versus": 0.1,
        "accuracy_vs_versus_ci_low": 0.05,
        "accuracy_vs_versus_ci_high": 0.15,
    }
    wiki = markdown_table(sampled).split("### corpus `facts`")[0]
    assert (
        "| Acc − the row it isolates a step against [95% CI] | – | +0.100 [+0.050, +0.150] vs no-retrieval | – |"
        in wiki
    )
    assert "retrorag: on a fixed sample of 4 of the 10 test questions (`rag_eval.framework_questions`)" in wiki
    assert "fixed sample" not in markdown_table(METRICS_BY_CORPUS)
    table = curves_table(SWEEP)
    assert "| flare | 0.875 | 0.750 | +0.125 | – | 0.50 |" in table
    assert "No retrieval: accuracy 0.500; always retrieving before generating: 1.000." in table


@pytest.fixture()
def tracking(tmp_path):
    store.configure("sqlite:///mlflow/mlflow.db", tmp_path)
    return str(tmp_path / "mlflow/artifacts")


def test_log_rag_runs_logs_one_run_per_corpus_and_configuration_and_replaces_earlier_ones(tracking):
    params = {
        "no-retrieval": {
            "triggers": [],
            "query": "question",
            "stepwise": False,
            "chunk": False,
            "steering": None,
            "context": None,
        },
        "flare": {
            "triggers": ["flare"],
            "query": "flare",
            "stepwise": False,
            "chunk": False,
            "steering": None,
            "context": None,
        },
    }
    digests = {"wiki": "w1", "facts": "f1"}
    first = log_rag_runs(
        METRICS_BY_CORPUS, SWEEP, params, "rag-test", {"llm": "tiny", "llm_digest": "abc"}, tracking, digests
    )
    runs = mlflow.search_runs(experiment_names=["rag-test"], run_view_type=ViewType.ACTIVE_ONLY)
    assert sorted(runs["run_id"]) == sorted(first) and len(first) == 5  # 2 corpora x 2 configurations + 1 swept trigger
    config_runs = runs[runs["tags.configuration"] != "sweep"]
    names = {
        frozenset(c[len("metrics.") :] for c in runs.columns if c.startswith("metrics.") and not pd.isna(row[c]))
        for _, row in config_runs.iterrows()
    }
    # the same names; a None recall left out
    assert names == {
        frozenset(METRICS) - {"answer_recall_at_k"},
        frozenset(METRICS),
    }
    flare_wiki = config_runs[
        (config_runs["tags.corpus"] == "wiki") & (config_runs["tags.configuration"] == "flare")
    ].iloc[0]
    assert (
        flare_wiki["tags.triggers"],
        flare_wiki["tags.query"],
        flare_wiki["tags.corpus_digest"],
        flare_wiki["tags.llm_digest"],
    ) == ("flare", "flare", "w1", "abc")
    assert flare_wiki["metrics.em"] == 0.3 and flare_wiki["params.stepwise"] == "False"
    assert set(config_runs[config_runs["tags.configuration"] == "no-retrieval"]["tags.triggers"]) == {"none"}
    sweep = runs[runs["tags.configuration"] == "sweep"].iloc[0]
    assert (sweep["tags.trigger"], sweep["metrics.area"], sweep["metrics.rate_to_always"]) == ("flare", 0.875, 0.5)

    second = log_rag_runs(
        METRICS_BY_CORPUS, None, params, "rag-test", {"llm": "tiny", "llm_digest": "abc"}, tracking, digests
    )
    active = mlflow.search_runs(experiment_names=["rag-test"], run_view_type=ViewType.ACTIVE_ONLY)
    assert sorted(active["run_id"]) == sorted(second) and len(second) == 4
    with pytest.raises(ValueError, match=r"configurations \['flare'\] have metrics but no params"):
        log_rag_runs(
            METRICS_BY_CORPUS,
            None,
            {"no-retrieval": params["no-retrieval"]},
            "rag-test",
            {"llm_digest": "abc"},
            tracking,
            digests,
        )
    with pytest.raises(ValueError, match=r"corpora \['facts'\] have no digest"):
        log_rag_runs(METRICS_BY_CORPUS, None, params, "rag-test", {"llm_digest": "abc"}, tracking, {"wiki": "w1"})
    # refused before logging
    assert len(mlflow.search_runs(experiment_names=["rag-test"], run_view_type=ViewType.ACTIVE_ONLY)) == 4


# ---- the rag_eval params section -----------------------------------------------------------------------------------


def rag_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_configuration_rows_take_the_shared_defaults_and_override_them():
    data = rag_params()
    rows = load_section("rag_eval", data=data).configurations
    defaults = data["rag_eval"]["configuration_defaults"]
    assert rows["sit"].query == defaults["query"] and rows["sit"].steering is None  # given by the defaults
    assert (rows["dior"].query, rows["dior"].stepwise, rows["ctrla"].steering) == (
        "dior",
        True,
        "ctrla-honesty@champion",
    )
    data["rag_eval"]["configuration_defaults"]["triggers"] = ["always"]
    with pytest.raises(ParamsError, match=r"configuration_defaults.triggers = \['always'\]: not a configuration key"):
        load_section("rag_eval", data=data)


def known(registry) -> str:
    """The pattern of a registry's names as an error lists them: every one, sorted."""
    return re.escape(", ".join(sorted(registry)))


@pytest.mark.parametrize(
    "path, value, message",
    [
        (
            ("configurations", "flare", "triggers"),
            ["flare", "dior early"],
            r"triggers\[1\] = 'dior early'.*<name>@<alias>",
        ),
        (
            ("configurations", "flare", "query"),
            "hyde",
            rf"configurations.flare.query = 'hyde': no query formulation of that name; known: {known(QUERIES)}$",
        ),
        (
            ("configurations", "flare", "triggers"),
            ["flare", "dior-early"],
            rf"triggers\[1\] = 'dior-early': no training-free trigger of that name; known: {known(TRAINING_FREE)} "
            r"or a registered detector as <name>@<alias>",
        ),
        (
            ("frameworks",),
            ["selfrag"],
            rf"frameworks\[0\] = 'selfrag': no framework of that name; known: {known(FRAMEWORKS)}$",
        ),
        (("configurations", "flare", "steering"), "ctrla-honesty", r"steering = 'ctrla-honesty'.*<name>@<alias>"),
        (("sweep", "corpus"), "web", r"sweep.corpus = 'web': must be one of rag_eval.corpora"),
        (("sweep", "query"), "dior", r"sweep.query = 'dior': must be one of \['question'\]"),
        (("thresholds", "rind"), "validation", r"thresholds.rind = 'validation': expected a number"),
        (("thresholds", "entropy"), 0.5, r"thresholds.entropy = 0.5: not a trigger of the configurations"),
        (("configurations", "utility", "triggers"), ["utility-{corpus}"], r"utility-\{corpus\}.*<name>@<alias>"),
        (("context",), "{question}", r"context = '\{question\}': must contain \{passages\}"),
        (
            ("settings", "stitch"),
            {"threshold": 0.5},
            r"settings.stitch = .*no trigger entry of that name; known: .*'sit'",
        ),
        (("configurations", "dior", "headline"), "yes", r"configurations.dior.headline = 'yes': expected"),
        (("corpora",), [], r"corpora = \[\]: name at least one corpus"),
        (("corpora",), ["wiki", "sweep"], r"corpora\[1\] = 'sweep': .* keys of the metrics file"),
        (("questions",), 0, r"questions = 0: must be positive"),
        (("framework_questions",), 0, r"framework_questions = 0: must be positive"),
        (
            ("configurations", "dior-always", "thresholds", "dior-realtime"),
            -1.0,
            r"configurations.dior-always.thresholds.dior-realtime = -1.0: not a trigger of this configuration",
        ),
        (
            ("configurations", "dior-always", "thresholds", "dior-early"),
            "always",
            r"dior-always.thresholds.dior-early = 'always'.*expected a number",
        ),
        (
            ("configurations", "dior", "versus"),
            "dior",
            r"configurations.dior.versus = 'dior': name another configuration",
        ),
        (
            ("configurations", "dior", "versus"),
            "web",
            r"configurations.dior.versus = 'web': name another configuration",
        ),
    ],
)
def test_bad_rag_eval_params_are_refused_naming_the_key(path, value, message):
    data = rag_params()
    node = data["rag_eval"]
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    with pytest.raises(ParamsError, match=message):
        load_section("rag_eval", data=data)


def test_rag_eval_params_fix_thresholds_by_trigger_name():
    data = rag_params()
    data["rag_eval"]["thresholds"] = {"flare": 0.5, "utility-wiki": 0.2, "ctrla-confidence": 0}
    section = load_section("rag_eval", data=data)
    assert section.thresholds == {"flare": 0.5, "utility-wiki": 0.2, "ctrla-confidence": 0}
    assert section.configurations["utility"].triggers == ["utility-{corpus}@champion"]


# ---- the stage's run files -----------------------------------------------------------------------------------------


def qa_table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "id": [f"q{i}" for i in range(8)],
            "question": [f"question {i}" for i in range(8)],
            "answers": [[f"a{i}"] for i in range(8)],
            "split": ["test", "train"] * 4,
        }
    )


def test_test_questions_are_a_deterministic_sample_of_the_test_split():
    rows = split_questions(qa_table(), "test", 3)
    assert len(rows) == 3 and set(rows["id"]) <= {"q0", "q2", "q4", "q6"}
    assert set(rows["id"]) == set(split_questions(qa_table().iloc[::-1], "test", 3)["id"])  # by id hash, not by order
    assert len(split_questions(qa_table(), "test", None)) == 4
    with pytest.raises(InputError, match="no test question"):
        split_questions(qa_table().assign(split="train"), "test", 3)


class Answerer:
    """``answer(questions, records)`` that counts the questions it answered and stops (as a killed run) at the
    ``stop_after``-th question: the shard it was in is lost. A question in ``failing`` comes back failed, as the loop
    records a question that raised."""

    def __init__(self, stop_after: int | None = None, failing: tuple[str, ...] = ()):
        self.calls, self.stop_after, self.failing = [], stop_after, failing

    def __call__(self, questions: list[str], records: list[bool]) -> list[dict]:
        out = []
        for question, record in zip(questions, records):
            if self.stop_after is not None and len(self.calls) == self.stop_after:
                raise KeyboardInterrupt
            self.calls.append((question, record))
            answer = "a0" if question.endswith("0") else "wrong"
            error = (
                "no passage retrieved"
                if question.endswith("4")
                else f"{FAILED} RuntimeError: boom"
                if question in self.failing
                else None
            )
            out.append(result(answer, error=error) | {"prompts": [f"prompt of {question}"] if record else []})
        return out


def test_a_killed_run_resumes_without_redoing_finished_questions(tmp_path):
    rows = pd.DataFrame({"id": [f"q{i}" for i in range(5)], "question": [f"question {i}" for i in range(5)]})
    run = tmp_path / "runs" / "wiki" / "flare"
    killed = Answerer(stop_after=3)
    with pytest.raises(KeyboardInterrupt):
        run_questions([Run(System("r", killed, "1"), run, {}, 2)], rows, "wiki · flare", shard_size=2)["r"]
    assert len(killed.calls) == 3  # the first shard of two is written, the second was lost with the run
    again = Answerer()
    lines = run_questions([Run(System("r", again, "1"), run, {}, 2)], rows, "wiki · flare", shard_size=2)["r"]
    assert again.calls == [("question 2", False), ("question 3", False), ("question 4", False)]  # only the missing ones
    assert [line["id"] for line in lines] == [f"q{i}" for i in range(5)]
    assert lines[0]["prompts"] == ["prompt of question 0"] and lines[2]["prompts"] == []  # prompts of the first 2 only
    # each shard with its manifest entry
    assert sorted(p.name for p in run.glob("shard-*")) == [
        name for k in range(3) for name in (f"shard-0000{k}.manifest.json", f"shard-0000{k}.parquet")
    ]
    m = summarise(lines, [[f"a{i}"] for i in range(5)])
    # a recorded outcome is counted, not a crash
    assert (m["accuracy"], m["no_passage"], m["failed"], m["n"]) == (
        0.2,
        1,
        0,
        5,
    )

    nothing = Answerer()
    assert (
        run_questions([Run(System("r", nothing, "1"), run, {}, 2)], rows, "wiki · flare", shard_size=2)["r"] == lines
        and nothing.calls == []
    )
    other = Answerer()
    # other code: every question again
    run_questions([Run(System("r", other, "2"), run, {}, 2)], rows, "wiki · flare", shard_size=2)["r"]
    assert len(other.calls) == 5
    fewer = Answerer()
    # other questions: their shards differ
    run_questions([Run(System("r", fewer, "2"), run, {}, 2)], rows.iloc[1:], "wiki · flare", shard_size=2)["r"]
    assert len(fewer.calls) == 4


def test_runs_answer_question_major_and_each_resumes_its_own_shards(tmp_path):
    """Several runs over the same questions answer shard after shard (each shard by every run before the next shard:
    what they share about a shard's questions, decoded first for all of them, stays small), and each run resumes from
    its own store."""
    rows = pd.DataFrame({"id": [f"q{i}" for i in range(4)], "question": [f"question {i}" for i in range(4)]})
    order = []

    class Logged(Answerer):
        def __init__(self, name, **kw):
            super().__init__(**kw)
            self.name = name

        def __call__(self, questions, records):
            order.append((self.name, tuple(questions)))
            return super().__call__(questions, records)

    shards = []
    runs = [Run(System("a", Logged("a"), "1"), tmp_path / "a"), Run(System("b", Logged("b"), "1"), tmp_path / "b")]
    lines = run_questions(
        runs, rows, "wiki · 2 configurations", shard_size=2, on_shard=lambda qs: shards.append((len(order), qs))
    )
    assert order == [
        ("a", ("question 0", "question 1")),
        ("b", ("question 0", "question 1")),
        ("a", ("question 2", "question 3")),
        ("b", ("question 2", "question 3")),
    ]
    assert shards == [(0, ["question 0", "question 1"]), (2, ["question 2", "question 3"])]
    assert set(lines) == {"a", "b"} and [x["id"] for x in lines["b"]] == ["q0", "q1", "q2", "q3"]
    order.clear()
    # b's code changed
    runs = [
        Run(System("a", Logged("a"), "1"), tmp_path / "a"),
        Run(System("b", Logged("b"), "2"), tmp_path / "b"),
    ]
    again = run_questions(runs, rows, "wiki · 2 configurations", shard_size=2)
    assert (
        order == [("b", ("question 0", "question 1")), ("b", ("question 2", "question 3"))] and again["a"] == lines["a"]
    )


def test_a_users_own_rag_system_runs_resumably_and_its_key_restarts_it(tmp_path):
    """Any object with ``name``, ``code``, ``key`` and ``answer`` is a RagSystem: its answers are stored and resumed,
    and a change to its own key (its settings) answers every question again, as a change to its code does."""

    class Mine:
        name, code = "mine", "c1"

        def __init__(self, top_k: int):
            self.key = {"params": {"top_k": top_k}}
            self.answerer = Answerer()

        def answer(self, questions: list[str], records: list[bool]) -> list[dict]:
            return self.answerer(questions, records)

    rows = pd.DataFrame({"id": [f"q{i}" for i in range(4)], "question": [f"question {i}" for i in range(4)]})
    first = Mine(5)
    lines = run_questions([Run(first, tmp_path / "mine")], rows, "wiki · mine", shard_size=2)["mine"]
    assert [x["answer"] for x in lines] == ["a0", "wrong", "wrong", "wrong"] and len(first.answerer.calls) == 4
    same = Mine(5)
    assert run_questions([Run(same, tmp_path / "mine")], rows, "wiki · mine", shard_size=2)["mine"] == lines
    assert same.answerer.calls == []  # resumed whole
    other = Mine(3)
    run_questions([Run(other, tmp_path / "mine")], rows, "wiki · mine", shard_size=2)
    assert len(other.answerer.calls) == 4  # its settings changed: every question again


def test_a_question_whose_loop_raised_is_answered_again_by_the_next_run(tmp_path):
    rows = pd.DataFrame({"id": [f"q{i}" for i in range(4)], "question": [f"question {i}" for i in range(4)]})
    first = run_questions(
        [Run(System("r", Answerer(failing=("question 1",)), "1"), tmp_path / "run")],
        rows,
        "facts · dior",
        shard_size=2,
    )["r"]
    assert summarise(first, [["a0"]] * 4)["failed"] == 1
    again = Answerer()
    lines = run_questions([Run(System("r", again, "1"), tmp_path / "run", {}, 0)], rows, "facts · dior", shard_size=2)[
        "r"
    ]
    assert again.calls == [("question 1", False)] and summarise(lines, [["a0"]] * 4)["failed"] == 0
    assert [line["id"] for line in lines] == [f"q{i}" for i in range(4)]


def test_curves_and_prompts_files(tmp_path):
    c = {"flare": curve("flare", [needs(0.9, True), needs(0.1, False)])}
    write_curves(tmp_path / "curves.csv", c)
    rows = list(csv.DictReader(open(tmp_path / "curves.csv")))
    assert [(r["trigger"], float(r["retrieval_rate"]), float(r["accuracy"])) for r in rows] == [
        ("flare", 0.0, 0.5),
        ("flare", 0.5, 1.0),
        ("flare", 1.0, 1.0),
    ]
    lines = {"wiki": {"flare": [{"id": "q0", "prompts": ["p0", "p1"]}, {"id": "q1", "prompts": []}]}}
    write_prompts(tmp_path / "prompts.jsonl", copy.deepcopy(lines), 1)
    assert [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()] == [
        {"corpus": "wiki", "configuration": "flare", "id": "q0", "prompts": ["p0", "p1"]}
    ]


def test_a_few_failed_questions_are_counted_and_a_systematic_failure_stops_the_stage():

    ok = result("Rome", [["Rome"]])
    failed = result("", [], error="failed: RuntimeError: boom")
    lines = [ok] * 4 + [failed]
    check_failures(lines, "wiki · x")  # one in five: recorded, the run goes on
    assert summarise(lines, [["Rome"]] * 5)["failed"] == 1
    with pytest.raises(RuntimeError, match="wiki · x: 3 of 5 questions failed, e.g. failed: RuntimeError: boom"):
        check_failures([ok, ok, failed, failed, failed], "wiki · x")


def test_the_curves_figure_draws_every_trigger_of_the_sweep_in_one_titled_png(tmp_path):
    from PIL import Image

    from detectors.evaluation.plots import write_rag_curves

    lines = [
        sweep_line(
            {"perfect": [(0.9 if needed else 0.1, 0)], "blind": [(0.5, 0)]},
            "x",
            {0: "Rome" if needed else "x"},
            ["Rome"],
        )
        for needed in [True, False] * 10
    ]
    swept = curves(lines, ["perfect", "blind"], bootstrap=100, seed=0)
    path = write_rag_curves(
        swept, tmp_path / "plots/rag_curves.png", "RAG: accuracy vs retrieval rate (sweep of corpus facts)"
    )
    assert path == tmp_path / "plots/rag_curves.png" and path.stat().st_size > 10_000
    with Image.open(path) as image:
        assert (
            image.text["Title"] == "RAG: accuracy vs retrieval rate (sweep of corpus facts)"
            and image.size[0] > image.size[1]
        )
    # an empty sweep (no trigger to sweep) still gives the figure a dvc.yaml declares
    assert write_rag_curves({}, tmp_path / "empty.png", "no trigger").stat().st_size > 0
