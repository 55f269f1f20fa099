"""benchmarks.stability: the seeds it moves and the spread it reports (its retraining is a whole pipeline run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.stability import markdown, point_stability, spread, with_seed

ROOT = Path(__file__).resolve().parents[1]


def test_with_seed_moves_the_three_training_seeds_and_nothing_else():
    text = (ROOT / "params.yaml").read_text(encoding="utf-8")
    before, after = yaml.safe_load(text), yaml.safe_load(with_seed(text, 100))
    for section in ("train_early", "train_realtime", "train_utility"):
        assert after[section]["training"]["seed"] == 100
        after[section]["training"]["seed"] = before[section]["training"]["seed"]
    assert after == before  # the directions, the evaluation's resamples and every other key keep theirs
    with pytest.raises(SystemExit, match="no train_early.training.seed"):
        with_seed("train_realtime:\n  training:\n    seed: 0\n", 1)


def test_a_row_is_stable_when_its_spread_is_below_half_the_narrowest_interval():
    trainings = {
        "a": {"rows": {"early · question · dior-early": [0.70, 0.60, 0.80], "x": [0.5, 0.4, 0.6]}},
        "b": {"rows": {"early · question · dior-early": [0.74, 0.66, 0.82], "x": [0.9, 0.8, 1.0]}},
    }
    rows = {r["row"]: r for r in spread(trainings)}
    assert rows["early · question · dior-early"]["spread"] == pytest.approx(0.04)
    assert rows["early · question · dior-early"]["half_interval"] == pytest.approx(0.08)
    assert rows["early · question · dior-early"]["stable"] and not rows["x"]["stable"]


def test_an_operating_point_that_moves_between_trainings_is_named_with_its_ties():
    def points(dior: str, ties: list[str]) -> dict:
        return {"wiki": {"dior": {"chosen": dior, "ties": ties}, "flare": {"chosen": "never", "ties": []}}}

    trainings = {
        "seed 0": {"rows": {}, "realtime_candidate": "all", "operating_points": points("never", ["best"])},
        "seed 100": {"rows": {}, "realtime_candidate": "all", "operating_points": points("best", ["never"])},
    }
    rows = {p["configuration"]: p for p in point_stability(trainings)}
    assert rows["flare"]["same"] and rows["flare"]["ties"] == []
    assert not rows["dior"]["same"]
    assert rows["dior"]["chosen"] == {"seed 0": "never", "seed 100": "best"}
    assert rows["dior"]["ties"] == ["best", "never"]
    page = markdown({"commit": "abc", "trainings": trainings, "rows": [], "operating_points": list(rows.values())})
    assert "| wiki | dior | `never` | `best` | **no** | `best`, `never` |" in page
    assert "The same operating point in every training: 1 of 2." in page
