"""benchmarks.stability: the seeds it moves and the spread it reports (its retraining is a whole pipeline run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.stability import claim_stability, markdown, point_stability, spread, verdict, with_seed

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


def test_a_rag_claim_is_stable_when_its_verdict_is_the_same_in_every_training():
    """A paired difference's verdict (above: interval above 0; below; level with) is what a README claim may say:
    a difference that moves but keeps its verdict is stable, one whose interval comes to include 0 is named."""
    assert [verdict([0.1, 0.02, 0.2]), verdict([-0.1, -0.2, -0.01]), verdict([0.0, -0.01, 0.01])] == [
        "above",
        "below",
        "level with",
    ]

    def rows(dior: list[float], utility: list[float]) -> dict:
        return {
            "facts · dior": {"accuracy": 0.9, "always": dior},
            "facts · utility": {"accuracy": 0.8, "always": utility},
        }

    trainings = {
        "seed 0": {"rag_rows": rows([0.08, 0.05, 0.11], [0.0, -0.03, 0.03])},
        "seed 100": {"rag_rows": rows([0.06, 0.03, 0.09], [0.02, -0.01, 0.05])},
        "seed 200": {"rag_rows": rows([0.02, -0.01, 0.05], [0.0, -0.03, 0.03])},
    }
    claims = {c["row"]: c for c in claim_stability(trainings)}
    assert claims["facts · utility"]["same"] and claims["facts · utility"]["moved"]
    assert not claims["facts · dior"]["same"]
    assert claims["facts · dior"]["verdict"] == {"seed 0": "above", "seed 100": "above", "seed 200": "level with"}
    page = markdown(
        {"commit": "abc", "trainings": {}, "rows": [], "operating_points": [], "claims": list(claims.values())}
    )
    assert "| facts · dior | always | +0.080 [+0.050, +0.110] above |" in page
    assert "Differences that moved: 2 of 2" in page and "same verdict in every training: 1 of 2." in page
