"""A new training-free trigger with settings of its own and an offline score is one module and one registry entry.

This file is that module: its settings' type, its scorer and its :class:`TriggerEntry`. The one entry is a line of
:data:`detectors.extensions.TRAINING_FREE` (added here for the test's duration). With nothing else written, the
trigger is validated by the params, built with its settings, swept and tuned on the validation questions, answers the
test questions in the loop, and is scored offline by the comparison. On the tiny Llama."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import edit_params, small_rag_params, write_params

from detectors.baselines.catalog import realtime_baselines
from detectors.config.core import fail
from detectors.errors import InputError
from detectors.evaluation.compare import compare_levels
from detectors.evaluation.scorers import TokenStatScorer
from detectors.extensions import TRAINING_FREE
from detectors.interfaces import Level
from detectors.rag.families import make_trigger, trigger_scorers
from detectors.rag.triggers import PROBABILITY, Policy, Trigger, TriggerContext, TriggerEntry
from pipelines import index_corpus, prepare, rag_eval

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

# ---- the module ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SurpriseSettings:
    """The trigger's own settings (``rag_eval.settings.surprise``): probabilities under ``floor`` count as ``floor``."""

    floor: float

    def check(self, where: str) -> None:
        if not 0 <= self.floor < 1:
            fail(f"{where}.floor", self.floor, "a probability in [0, 1)")


@dataclasses.dataclass(frozen=True)
class Surprise(TokenStatScorer):
    """1 - a token's probability, the probability floored; an entity takes its most surprising token."""

    name: str = "surprise"
    stat: str = "prob"
    floor: float = 0.0

    def token(self, values: np.ndarray) -> np.ndarray:
        return 1.0 - np.maximum(np.asarray(values, dtype=np.float64), self.floor)


def build(context: TriggerContext, settings: SurpriseSettings | None) -> Trigger:
    scorer = Surprise(Level.TOKEN, floor=settings.floor if settings else 0.0)
    policy = Policy("token", cut="segment", after_retrieval="accept")
    return Trigger("surprise", scorer, math.inf, policy, scores=PROBABILITY)


ENTRY = TriggerEntry(build, SurpriseSettings, Surprise)

# ---- the tests -----------------------------------------------------------------------------------------------


@pytest.fixture
def registered(monkeypatch):
    """The one registry entry."""
    monkeypatch.setitem(TRAINING_FREE.entries, "surprise", f"{__name__}:ENTRY")


def test_its_settings_are_its_own_and_checked_by_its_type(registered, tiny_llm):
    trigger = make_trigger("surprise", tiny_llm, {"surprise": 0.4}, settings={"surprise": {"floor": 0.25}})
    assert (trigger.threshold, trigger.scorer.floor, trigger.entry) == (0.4, 0.25, "surprise")
    assert trigger.settings == SurpriseSettings(0.25)  # what a run's key holds
    assert trigger.token_scores({"prob": np.array([0.9, 0.1])}).tolist() == pytest.approx([0.1, 0.75])
    with pytest.raises(InputError, match=r"rag_eval\.settings\.surprise\.floor = 1\.5: a probability in \[0, 1\)"):
        make_trigger("surprise", tiny_llm, {"surprise": 0.4}, settings={"surprise": {"floor": 1.5}})
    with pytest.raises(InputError, match=r"rag_eval\.settings\.flare: trigger 'flare' takes no settings"):
        make_trigger("flare", tiny_llm, {"flare": 0.4}, settings={"flare": {"floor": 0.1}})


def test_the_comparison_scores_it_offline(registered):
    """The comparison's real-time scorers gain the trigger's offline score, once, beside the catalog's."""
    listed = realtime_baselines(Level.TOKEN, {"prob", "entropy"})
    added = trigger_scorers(Level.TOKEN, {"prob", "entropy"}, listed)
    assert [type(s) for s in added if isinstance(s, Surprise)] == [Surprise]
    assert not {type(s) for s in added} & {type(s) for s in listed}  # FLARE's, the entropies' ... are not doubled
    rng = np.random.default_rng(0)
    probs = rng.uniform(0, 1, 40)
    labels = (probs < 0.5).astype(int)  # the unlikely tokens are the hallucinated ones
    units = pd.DataFrame(
        {
            "id": [f"r{i}:0" for i in range(40)],
            "group": [f"r{i}" for i in range(40)],
            "split": ["val"] * 20 + ["test"] * 20,  # the threshold is chosen on validation
            "label": labels,
            "status": "ok",
            "stats": [{"prob": np.array([p])} for p in probs],
        }
    )
    scorer = next(s for s in added if isinstance(s, Surprise))
    results, _, _ = compare_levels({Level.TOKEN: units}, {Level.TOKEN: [scorer]}, "prevalence", 5, 20, 0)
    assert results["token"]["surprise"]["auroc"] == 1.0


def test_it_runs_through_the_sweep_the_tuning_and_the_loop(registered, tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, tiny_checkpoint)
    edit_params(tmp_path, "qa", limit=24)
    prepare.main(["--params", "params.yaml"])
    configurations = {"no-retrieval": None, "single-round": None, "surprise": {"triggers": ["surprise"]}}
    params = small_rag_params(tmp_path, configurations, settings={"surprise": {"floor": 0.05}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    index_corpus.main(["--params", "params.yaml"])
    rag_eval.main(["--params", "params.yaml"])

    metrics = json.loads((tmp_path / "data/metrics/rag_eval.json").read_text())
    assert "surprise" in metrics["sweep"]["curves"]  # swept on the test questions
    tuned = metrics["tuning"]["facts"]["surprise"]  # tuned on the validation ones
    assert [c["label"] for c in tuned["candidates"]][:2] == ["never", "always"]
    assert metrics["thresholds"]["facts"]["surprise"] == {"surprise": tuned["thresholds"]["surprise"]}
    row = metrics["facts"]["surprise"]  # and answered the test questions in the loop
    assert row["n"] == 6 and 0 <= row["accuracy"] <= 1 and "val_accuracy" in row
    stored = [
        json.loads(line)
        for shard in sorted((tmp_path / "data/rag/runs/facts/surprise").glob("shard-*.parquet"))
        for line in pd.read_parquet(shard)["line"]
    ]
    assert len(stored) == 6
    manifest = json.loads((tmp_path / "data/rag/runs/facts/surprise/manifest.json").read_text())
    assert manifest["config"]["params"]["settings"] == {"surprise": {"floor": 0.05}}  # its settings key its runs
