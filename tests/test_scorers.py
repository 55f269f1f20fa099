"""One Scorer interface for every level: the real-time baselines and the detector's scores on hand-made
records, computed by hand; the four registered kinds share one Detector interface."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest

from detectors.baselines.catalog import QUESTION_BASELINES, REALTIME_BASELINES, question_baselines, realtime_baselines
from detectors.baselines.flare import Flare
from detectors.baselines.logreg import LogisticScorer
from detectors.evaluation.compare import compare
from detectors.evaluation.scorers import realtime_detector_scorer
from detectors.evaluation.units import realtime_units
from detectors.interfaces import Detector, Level, Scorer

# two continuations: r1 has tokens 0..3, entity A = tokens [0, 1] (hallucinated), entity B = token [3] (supported);
# r2 has tokens 0..2, entity C = tokens [1, 2] (supported)
PROB = {"r1": [0.5, 0.2, 0.9, 0.8], "r2": [0.6, 0.9, 0.7]}
ENTROPY = {"r1": [1.0, 2.0, 0.1, 0.5], "r2": [0.3, 0.2, 0.4]}
MLP = {"r1": [0.9, 0.7, np.nan, 0.1], "r2": [np.nan, 0.3, 0.2]}
RIND = {"r1": [0.0, 0.4, 0.6, 0.1], "r2": [0.7, 0.2, 0.0]}  # token 2 of r1 and token 0 of r2 are in no entity


def frame() -> pd.DataFrame:
    rows = [
        {
            "id": "r1",
            "split": "test",
            "status": "ok",
            "label": 1,
            "token_label": [1, 1, -1, 0],
            "entities": json.dumps([{"tokens": [0, 1], "hallucinated": 1}, {"tokens": [3], "hallucinated": 0}]),
        },
        {
            "id": "r2",
            "split": "test",
            "status": "ok",
            "label": 0,
            "token_label": [-1, 0, 0],
            "entities": json.dumps([{"tokens": [1, 2], "hallucinated": 0}]),
        },
        {
            "id": "r3",
            "split": "test",
            "status": "ValueError: no entity",
            "label": None,
            "token_label": None,
            "entities": None,
        },
    ]
    return pd.DataFrame(rows)


def units() -> dict[Level, pd.DataFrame]:
    stats = {
        r: {
            "prob": np.array(PROB[r]),
            "entropy": np.array(ENTROPY[r]),
            "mlp": np.array(MLP[r]),
            "rind": np.array(RIND[r]),
        }
        for r in PROB
    }
    return realtime_units(frame(), stats)


def scores(level: Level) -> dict[str, list[float]]:
    table = units()[level]
    scorers = [realtime_detector_scorer(level)] + realtime_baselines(level, {"prob", "entropy", "mlp", "rind"})
    assert all(isinstance(s, Scorer) and s.level is level for s in scorers)
    return {s.name: np.round(s.score(table), 6).tolist() for s in scorers}


def test_unit_tables_hold_each_level_s_units_and_labels():
    u = units()
    assert u[Level.TOKEN]["id"].tolist() == ["r1:0", "r1:1", "r1:3", "r2:1", "r2:2"]
    assert u[Level.TOKEN]["label"].tolist() == [1, 1, 0, 0, 0]
    assert u[Level.ENTITY]["id"].tolist() == ["r1:e0", "r1:e1", "r2:e0"] and u[Level.ENTITY]["label"].tolist() == [
        1,
        0,
        0,
    ]
    assert u[Level.CONTINUATION]["id"].tolist() == ["r1", "r2"]  # the failed record is no unit


def test_token_level_scores():
    assert scores(Level.TOKEN) == {
        "mlp": [0.9, 0.7, 0.1, 0.3, 0.2],
        "flare": [0.5, 0.8, 0.2, 0.1, 0.3],  # 1 - p
        "token_entropy": [1.0, 2.0, 0.5, 0.2, 0.4],
        "rind": [0.0, 0.4, 0.1, 0.2, 0.0],
    }


def test_entity_level_scores_follow_stitch_in_time():
    got = scores(Level.ENTITY)
    assert got["mlp"] == [0.9, 0.1, 0.3]  # max over the entity's tokens
    assert got["sit_min"] == [0.8, 0.2, 0.3]  # 1 - min p
    assert got["sit_avg"] == [0.65, 0.2, 0.2]  # 1 - mean p
    assert got["sit_norm"] == pytest.approx([1 - np.sqrt(0.1), 0.2, 1 - np.sqrt(0.63)], abs=1e-6)  # 1 - geometric mean
    assert got["token_entropy"] == [2.0, 0.5, 0.4]
    assert got["rind"] == [0.4, 0.1, 0.2]  # max over the entity's tokens
    assert "flare" not in got  # FLARE is a token and continuation score


def test_continuation_level_takes_the_worst_entity_and_flare_its_least_probable_token():
    got = scores(Level.CONTINUATION)
    assert got["flare"] == [0.8, 0.4]  # over every generated token, entity or not
    assert got["sit_min"] == [0.8, 0.3] and got["mlp"] == [0.9, 0.3] and got["token_entropy"] == [2.0, 0.4]
    assert got["rind"] == [0.6, 0.7]  # DRAGIN fires on any generated token, entity or not


def test_detector_probabilities_only_where_it_was_trained_thresholds_chosen_on_validation():
    token, entity = realtime_detector_scorer(Level.TOKEN), realtime_detector_scorer(Level.ENTITY)
    assert (token.threshold, token.is_probability, token.kind) == (None, True, "detector")
    assert (entity.threshold, entity.is_probability) == (None, False)  # chosen and calibrated on validation


def test_a_scorer_at_a_level_it_does_not_define_is_refused():
    with pytest.raises(ValueError, match="'flare' is not defined at the entity level"):
        Flare(Level.ENTITY)


def test_compare_refuses_scorers_of_different_levels():
    mixed = [Flare(Level.TOKEN), Flare(Level.CONTINUATION)]
    with pytest.raises(ValueError, match="one level at a time"):
        compare(units()[Level.TOKEN], mixed, "youden", 10)


def test_question_baselines_are_those_whose_columns_exist():
    """Every registered question-level baseline is listed exactly when its column exists, in the registry's order,
    after the logistic probe (when its inputs exist) and before CtrlA's scorers, one per ``ctrla_confidence*``
    column."""
    early = {"attribution", "entropy", "first_token_prob", "first_token_entropy", "first_token_margin", "answer"}
    joined = early | {
        "retrorag_self_evaluation",
        "retrorag_self_consistency",
        "ctrla_confidence",
        "ctrla_confidence[val]",
    }
    probe = LogisticScorer()
    for columns in (early, joined, {"first_token_prob"}):
        names = [s.name for s in question_baselines(columns)]
        for name in QUESTION_BASELINES:
            scorer = QUESTION_BASELINES.load(name)
            assert scorer.name == name and (name in names) == (scorer.column in columns), (name, columns)
        assert [n for n in names if n in QUESTION_BASELINES] == [n for n in QUESTION_BASELINES if n in names]
        if set(probe.columns) <= columns:  # the logistic probe first, when its inputs exist
            assert names[0] == probe.name
        else:
            assert probe.name not in names
    names = [s.name for s in question_baselines(early)]
    assert names[0] == "logreg[attribution+first_token]"
    assert {"attribution_entropy", "first_token_prob", "first_token_entropy"} <= set(names)
    assert not any(n.startswith(("retrorag", "ctrla")) for n in names)
    scorers = question_baselines(joined)
    by_name = {s.name: s for s in scorers}
    assert {"retrorag_self_consistency", "retrorag_self_evaluation"} <= set(by_name)
    assert [s.name for s in scorers][-2:] == ["ctrla_confidence", "ctrla_confidence[val]"]
    assert all(s.level is Level.QUESTION for s in scorers)
    names = [s.name for s in question_baselines({"first_token_prob"})]
    assert "first_token_prob" in names and probe.name not in names  # no probe without its inputs
    table = pd.DataFrame({"retrorag_self_evaluation": [0.9, 0.2], "retrorag_self_consistency": [0.3, 0.8]})
    assert by_name["retrorag_self_evaluation"].score(table).tolist() == [-0.9, -0.2]  # a low P(yes): hallucinated
    assert by_name["retrorag_self_consistency"].score(table).tolist() == [-0.3, -0.8]


def test_realtime_baselines_are_those_whose_stats_exist():
    """Every registered per-token baseline is listed at a level exactly when it is defined there and its statistic
    exists, in the registry's order, before CtrlA's scorers, one per ``ctrla_confidence*`` statistic."""
    cases = {
        Level.TOKEN: {"prob"},
        Level.ENTITY: {"entropy", "rind"},
        Level.CONTINUATION: {"prob", "ctrla_confidence", "ctrla_confidence[val]", "mlp"},
    }
    listed = {}
    for level, stats in cases.items():
        got = realtime_baselines(level, stats)
        names = listed[level] = [s.name for s in got]
        for name in REALTIME_BASELINES:
            cls = REALTIME_BASELINES.load(name)
            assert (name in names) == (level in cls.levels and cls.stat in stats), (level, name)
        assert [n for n in names if n in REALTIME_BASELINES] == [n for n in REALTIME_BASELINES if n in names]
        assert all(s.level is level and s.stat in stats for s in got)
    assert "flare" in listed[Level.TOKEN] and {"token_entropy", "rind"} <= set(listed[Level.ENTITY])
    continuation = listed[Level.CONTINUATION]
    assert {"flare", "sit_min", "sit_avg", "sit_norm"} <= set(continuation)
    assert continuation[-2:] == ["ctrla_confidence", "ctrla_confidence[val]"]
    got = realtime_baselines(Level.CONTINUATION, cases[Level.CONTINUATION])
    assert got[-1].stat == "ctrla_confidence[val]" and got[-1].level is Level.CONTINUATION


def test_every_registered_kind_is_a_detector_with_one_llm_attachment():
    from detectors.registry.kinds import KINDS, detector_class

    for kind in KINDS:
        cls = detector_class(kind)
        assert issubclass(cls, Detector) and cls.KIND == kind
        assert not getattr(cls, "__abstractmethods__", None), f"{kind} leaves {cls.__abstractmethods__} unimplemented"
        assert cls.load_llm is Detector.load_llm and cls.attach is Detector.attach  # written once
    known = re.escape(", ".join(sorted(KINDS)))  # every registered kind
    with pytest.raises(ValueError, match=rf"^no detector kind named 'dior-late'; known: {known}$"):
        detector_class("dior-late")
