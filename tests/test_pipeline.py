"""The whole DAG on the tiny Llama and the hand-made QA and article fixtures: prepare → build_early →
train_early, prepare_articles → build_realtime → train_realtime, evaluate → register, then the
registered detectors loaded back through the inference module. The stages run once per test run (``pipeline`` in
tests/conftest.py, shared with other modules); a test that runs a stage again or registers works on its own copy
(``pipeline_copy``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import ROOT, build_tiny_llama, known_facts, run_ctrla_stages
from safetensors.numpy import load_file

from detectors import load_detector
from detectors.errors import InputError
from detectors.evaluation.metrics import auroc
from detectors.llm.fingerprint import LLMMismatchError
from detectors.llm.loading import LLM
from detectors.registry.store import register, validation_digest
from pipelines import (
    build_early,
    build_realtime,
    evaluate,
    train_early,
)
from pipelines import register as register_stage

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def test_prepare_reports_bad_records_and_splits(pipeline):
    report = json.loads((pipeline / "data/prepared/qa_report.json").read_text())
    assert report["accepted"] == 48
    assert report["rejected_reasons"] == {
        "duplicate question: answers merged into the first": 1,
        "empty question (field question)": 1,
        "no usable reference answer (field answers)": 1,
    }
    table = pd.read_parquet(pipeline / "data/prepared/qa.parquet")
    france = table[table["question"] == "The capital of France is"].iloc[0]
    assert list(france["answers"]) == ["Paris", "Paris, France"]
    assert set(table["split"]) == {"train", "val", "test"}
    manifest = json.loads((pipeline / "data/llm/llm.json").read_text())
    assert manifest["kind"] == "checkpoint" and manifest["fingerprint"]["num_layers"] == 2


def test_early_set_has_both_labels_and_valid_features(pipeline):
    frame = pd.read_parquet(pipeline / "data/early/early.parquet")
    assert (frame["status"] == "ok").all() and len(frame) == 48
    for split in ("train", "val", "test"):
        assert frame.loc[frame["split"] == split, "label"].nunique() == 2, split
    for row in frame.itertuples():
        assert len(row.attribution) == len(row.question_tokens)
        assert np.isclose(np.sum(row.attribution), 1.0, atol=1e-5)
        assert 0 <= row.entropy <= np.log(len(row.attribution)) + 1e-6
        assert len(row.hidden) == 2 * 64
        assert len(row.answer_ids) == len(row.answer_prob) == len(row.answer_entropy) and (
            row.answer_hidden_offset >= 0
        ) == (len(row.answer_ids) > 0)
    # every answer token's hidden states at build_early.answer_hidden_layers (2 layers of 64), rows in answer order
    hidden = load_file(str(pipeline / "data/early/answer_hidden.safetensors"))["hidden"]
    assert hidden.shape == (sum(map(len, frame["answer_ids"])), 2 * 64)
    # memorised facts are answered correctly far more often than the others
    report = json.loads((pipeline / "data/early/report.json").read_text())
    assert report["hallucination_rate"] == pytest.approx(frame["label"].mean(), abs=1e-3)
    memorised, correct = frame["question"].isin({r["question"] for r in known_facts()}), 1 - frame["label"]
    assert correct[memorised].mean() >= correct[~memorised].mean() + 0.4  # measured: 0.58 vs 0.0


def test_build_early_resumes_without_redoing_finished_shards(pipeline_copy):
    pipeline = pipeline_copy  # it deletes and rebuilds the early set: its own copy, the working directory
    shards = sorted((pipeline / "data/early/shards").glob("shard-*.parquet"))
    before = pd.read_parquet(pipeline / "data/early/early.parquet")
    stamps = {p.name: p.stat().st_mtime_ns for p in shards[:-1]}
    shards[-1].unlink()  # as if the run had been killed during the last shard
    (pipeline / "data/early/early.parquet").unlink()
    build_early.main(["--params", "params.yaml"])
    assert {p.name: p.stat().st_mtime_ns for p in shards[:-1]} == stamps
    after = pd.read_parquet(pipeline / "data/early/early.parquet")
    pd.testing.assert_frame_equal(
        before.drop(columns=["attribution", "hidden"]), after.drop(columns=["attribution", "hidden"])
    )
    np.testing.assert_allclose(np.concatenate(before["attribution"]), np.concatenate(after["attribution"]), atol=1e-6)


def evaluation_runs(pipeline: Path, dataset: str) -> pd.DataFrame:
    mlflow.set_tracking_uri(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}")
    return mlflow.search_runs(experiment_names=[f"detector-evaluation-{dataset}"])


def test_evaluate_writes_same_metrics_for_every_scorer(pipeline):
    metrics = json.loads((pipeline / "data/metrics/evaluate_early.json").read_text())
    rows = {p.stem: json.loads(p.read_text()) for p in (pipeline / "data/metrics/detectors").glob("*.json")}
    assert set(rows) == {"early_question", "realtime_token", "realtime_entity", "realtime_continuation"}  # the headline
    best = max(m["auroc"] for m in metrics["question"].values() if m["kind"] == "detector" and "auroc" in m)
    assert rows["early_question"]["dior"] == round(best, 4)
    assert set(metrics) == {"question"}  # {level: {scorer: metrics}}, the shape of the real-time file too
    metrics = metrics["question"]
    assert {
        "dior-early",
        "dior-early-extended",
        "gru[attribution]",
        "logreg[attribution+first_token]",
        "attribution_entropy",
        "first_token_prob",
        "first_token_entropy",
    } <= set(metrics)
    keys = {
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
    }
    scores = pd.read_parquet(pipeline / "data/eval/early_scores.parquet")
    test = scores[scores["split"] == "test"]
    for name, m in metrics.items():
        assert keys <= set(m), name
        assert m["auroc_ci_low"] <= m["auroc"] <= m["auroc_ci_high"], name
        # of the stored test-split scores
        assert m["auroc"] == pytest.approx(auroc(test["label"], test[name]), abs=1e-6), name
        assert m["trigger_rate"] == pytest.approx(float((test[name] >= m["threshold"]).mean())), name
    # what the tiny Llama planted (memorised facts answered right, and confidently) shows in the training-free
    # first-token
    # probability. The trained scorers are not asserted here: fitted on 24 questions with 12 to choose their epoch or C,
    # their test AUROC on 12 questions swings with the split (0.53-0.88 for the logistic probe when the fixture's ids
    # still depended on the checkout's path); test_training checks that they learn.
    assert metrics["first_token_prob"]["auroc"] > 0.7
    best = max((n for n, m in metrics.items() if m["kind"] == "baseline"), key=lambda n: metrics[n]["auroc"])
    # each trained detector against the best baseline, on the same questions
    for name in (
        "dior-early",
        "dior-early-extended",
        "gru[attribution]",
    ):
        assert metrics[name]["delta_vs"] == best
        assert metrics[name]["delta_auroc"] == pytest.approx(metrics[name]["auroc"] - metrics[best]["auroc"])
        assert metrics[name]["delta_ci_low"] <= metrics[name]["delta_auroc"] <= metrics[name]["delta_ci_high"]
    for kind in ("roc", "pr", "reliability"):
        assert {p.stem for p in (pipeline / f"data/plots/{kind}/early_question").glob("*.csv")} == set(metrics), kind
    assert (pipeline / "data/plots/figures/early_question_curves.png").stat().st_size > 0
    assert (pipeline / "data/plots/figures/early_question_ecdf.png").stat().st_size > 0
    assert {p.name for p in (pipeline / "data/plots/early_entropy_ecdf").glob("*.csv")} == {
        "correct.csv",
        "hallucinated.csv",
    }
    runs = evaluation_runs(pipeline, "early")  # one flat run per scorer
    assert sorted(runs["tags.detector"]) == sorted(metrics) and (runs["tags.level"] == "question").all()
    by_name = runs.set_index("tags.detector")
    for name, m in metrics.items():
        assert (
            by_name.loc[name, "metrics.test_auroc"] == pytest.approx(m["auroc"])
            and by_name.loc[name, "tags.kind"] == m["kind"]
        )


def test_comparison_table_holds_every_scorer_dataset_and_level(pipeline):
    table = pd.read_parquet(pipeline / "data/eval/comparison.parquet")
    early = json.loads((pipeline / "data/metrics/evaluate_early.json").read_text())
    realtime = json.loads((pipeline / "data/metrics/evaluate_realtime.json").read_text())
    expected = {("early", lv, n) for lv, by in early.items() for n in by} | {
        ("realtime", lv, n) for lv, by in realtime.items() for n in by
    }
    assert set(zip(table["dataset"], table["level"], table["scorer"])) == expected and len(table) == len(expected)
    detectors = table[table["kind"] == "detector"]
    assert detectors["delta_vs"].notna().all() and table.loc[table["kind"] == "baseline", "delta_vs"].isna().all()
    text = (pipeline / "docs/results/comparison.md").read_text()
    for level in ("early · question", "realtime · token", "realtime · entity", "realtime · continuation"):
        assert f"## {level} (test: " in text
    mlp = realtime["continuation"]["mlp"]
    assert f"| mlp | detector | {mlp['auroc']:.3f} [{mlp['auroc_ci_low']:.2f}, {mlp['auroc_ci_high']:.2f}] |" in text
    # token and entity intervals resample continuations: a token's group is its record
    scores = pd.read_parquet(pipeline / "data/eval/realtime_scores.parquet")
    tokens = scores[scores["level"] == "token"]
    assert (tokens["group"] == tokens["id"].str.split(":").str[0]).all()


def test_each_trained_detector_shows_its_single_seeds_beside_its_row(pipeline):
    """Every trained detector is a seed ensemble (two seeds here); the comparison reports the test AUROC of each seed's
    net alone beside the ensemble's row: in the metrics, on the results page and in the MLflow runs."""
    from detectors.dior.early_detector import load_early_detectors

    early = json.loads((pipeline / "data/metrics/evaluate_early.json").read_text())["question"]
    frame = pd.read_parquet(pipeline / "data/early/early.parquet")
    test = frame[(frame["status"] == "ok") & (frame["split"] == "test")]
    for name, detector in load_early_detectors(pipeline / "data/models/early").items():
        singles = [auroc(test["label"], d.predict_proba(test)) for d in detector.per_seed()]
        m = early[name]
        assert m["seeds"] == len(singles) == 2 and detector.info["seeds"] == [0, 1]
        assert (m["seed_auroc_min"], m["seed_auroc_max"]) == pytest.approx((min(singles), max(singles)))
        assert m["seed_auroc_sd"] == pytest.approx(np.std(singles, ddof=1))
    assert all("seeds" not in m for m in early.values() if m["kind"] != "detector")
    assert early["logreg[attribution+first_token]"]["kind"] == "trained baseline"  # fitted on train: listed apart
    realtime = json.loads((pipeline / "data/metrics/evaluate_realtime.json").read_text())
    for level, scorer in (
        ("token", "mlp"),
        ("entity", "mlp"),
        ("continuation", "mlp"),
        ("continuation", "mlp[served]"),
    ):
        assert realtime[level][scorer]["seeds"] == 2, (level, scorer)
    text = (pipeline / "docs/results/comparison.md").read_text()
    m = early["dior-early"]
    assert f"| {m['seed_auroc_min']:.3f}–{m['seed_auroc_max']:.3f} (sd {m['seed_auroc_sd']:.3f}, 2 seeds) |" in text
    runs = evaluation_runs(pipeline, "early").set_index("tags.detector")
    assert runs.loc["dior-early", "metrics.seed_auroc_max"] == pytest.approx(m["seed_auroc_max"])


def test_evaluate_joins_score_tables_and_reads_every_early_detector_directory(pipeline_copy):
    """CtrlA score tables with several columns join by id; every early detector directory is a scorer."""
    pipeline = pipeline_copy  # it evaluates again, logging to the store: its own copy, the working directory
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    alt = pipeline / "alt"
    alt.mkdir()
    early = pd.read_parquet(pipeline / "data/early/early.parquet")
    ok = early[early["status"] == "ok"]
    pd.DataFrame(
        {"id": ok["id"], "ctrla_confidence": -ok["first_token_prob"], "ctrla_confidence[val]": ok["entropy"]}
    ).to_parquet(alt / "ce.parquet")
    frame = pd.read_parquet(pipeline / "data/realtime/realtime.parquet")
    ok = frame[frame["status"] == "ok"]
    pd.DataFrame({"id": ok["id"], "ctrla_confidence": [list(1 - np.asarray(p)) for p in ok["prob"]]}).to_parquet(
        alt / "cr.parquet"
    )
    params["paths"].update(
        ctrla_early=str(alt / "ce.parquet"),
        ctrla_realtime=str(alt / "cr.parquet"),
        **{
            k: str(alt / Path(params["paths"][k]).name)
            for k in (
                "early_scores",
                "realtime_scores",
                "evaluate_early_metrics",
                "evaluate_realtime_metrics",
                "comparison",
                "comparison_table",
            )
        },
        plots=str(alt / "plots"),
    )
    params["evaluate"].update(experiment="alt-evaluation", bootstrap=200)
    (pipeline / "params_alt.yaml").write_text(yaml.safe_dump(params))
    evaluate.main(["--params", "params_alt.yaml"])
    table = pd.read_parquet(alt / "comparison.parquet")
    question = table[table["level"] == "question"].set_index("scorer")
    assert {
        "dior-early",
        "dior-early-extended",
        "gru[attribution]",
        "ctrla_confidence",
        "ctrla_confidence[val]",
    } <= set(question.index)
    # a joined column scores as itself: -first_token_prob is first_token_prob's baseline
    assert question.loc["ctrla_confidence", "auroc"] == pytest.approx(question.loc["first_token_prob", "auroc"])
    realtime = table[table["dataset"] == "realtime"]
    assert set(realtime.loc[realtime["scorer"] == "ctrla_confidence", "level"]) == {"token", "entity", "continuation"}
    token = realtime[realtime["level"] == "token"].set_index("scorer")
    # the list became a per-token stat
    assert token.loc["ctrla_confidence", "auroc"] == pytest.approx(token.loc["flare", "auroc"])
    mlflow.set_tracking_uri(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}")
    assert set(mlflow.search_runs(experiment_names=["alt-evaluation-early"])["tags.detector"]) == set(question.index)


def test_train_early_writes_each_named_detector_and_ablation_in_its_own_directory(pipeline):
    """dior-early is DioR's RNN over IG(Q) (attribution and its entropy); the extended set and the ablation sit beside
    it."""
    models = pipeline / "data/models/early"
    assert {d.name for d in models.iterdir()} == {"dior-early", "dior-early-extended", "gru[attribution]"}
    configs = {d.name: json.loads((d / "detector.json").read_text()) for d in models.iterdir()}
    assert {name: c["name"] for name, c in configs.items()} == {name: name for name in configs}
    assert configs["dior-early"]["groups"] == ["attribution", "entropy"]
    assert configs["dior-early-extended"]["groups"] == ["attribution", "entropy", "first_token", "hidden"]
    metrics = json.loads((pipeline / "data/metrics/train_early.json").read_text())
    assert set(metrics) == set(configs) and all(m["paper_threshold"] == 0.5 for m in metrics.values())
    for name, m in metrics.items():
        assert m["threshold"] == configs[name]["threshold"] and 0 <= m["val_trigger_rate"] <= 1, name


def test_train_early_leaves_only_this_runs_detectors(pipeline_copy, tmp_path):
    """A rerun with fewer detectors removes the others: evaluate scores every sub-directory of paths.early_model."""
    pipeline = pipeline_copy  # it trains again: its own copy, the working directory
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["train_early"].update(detectors={"dior-early": ["attribution", "entropy"]}, ablation=[])
    params["train_early"]["training"].update(max_epochs=1)
    params["paths"].update(early_model=str(tmp_path / "early"), train_early_metrics=str(tmp_path / "train_early.json"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    for stale in ("gru[hidden]", "ablation"):
        (tmp_path / "early" / stale).mkdir(parents=True)
    train_early.main(["--params", str(tmp_path / "params.yaml")])
    assert [d.name for d in (tmp_path / "early").iterdir()] == ["dior-early"]
    assert not (tmp_path / "early.partial").exists()
    assert set(json.loads((tmp_path / "train_early.json").read_text())) == {"dior-early"}


def test_registered_detector_serves_the_features_it_was_trained_on(pipeline, tiny_llm):
    registered = {p.stem for p in (pipeline / "data/registry").glob("*.json")}
    assert registered == {"dior-early", "dior-early-extended", "dior-realtime"}  # one file per registered detector
    registry_out = json.loads((pipeline / "data/registry/dior-early.json").read_text())
    assert registry_out["name"] == "dior-early"
    assert registry_out["version"] == 1 and registry_out["alias_moved"] and registry_out["decision"] == "champion"
    early = pd.read_parquet(pipeline / "data/early/early.parquet")
    val_ids = early.loc[(early["status"] == "ok") & (early["split"] == "val"), "id"]
    assert registry_out["val_digest"] == validation_digest(val_ids)
    # the artifact records where its LLM is relative to the project, and its dtype
    for model in (
        "early/dior-early",
        "realtime",
    ):
        llm_section = json.loads((pipeline / f"data/models/{model}/detector.json").read_text())["llm"]
        assert llm_section["dir"] == "data/llm" and llm_section["dtype"] == "float32"
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    detector = load_detector("dior-early", alias="champion", tracking_uri=uri, llm=tiny_llm)
    assert (detector.name, detector.groups) == ("dior-early", ["attribution", "entropy"])  # DioR's RNN over IG(Q)
    frame = pd.read_parquet(pipeline / "data/early/early.parquet")
    row = frame[frame["question"] == "The capital of Spain is"].iloc[0]
    decision = detector.assess("The capital of Spain is")
    # serving recomputes the features with the same code: same attribution, same probability
    np.testing.assert_allclose(decision.attribution, row["attribution"], atol=1e-5)
    stored = detector.predict_proba([row.to_dict()])[0]
    assert decision.probability == pytest.approx(float(stored), abs=1e-5)
    assert decision.retrieve == (decision.probability >= detector.threshold)
    assert set(decision.keywords) <= {"The", "capital", "of", "Spain", "is"} and decision.keywords


def test_extended_early_detector_is_registered_under_its_own_name(pipeline, tiny_llm):
    out = json.loads((pipeline / "data/registry/dior-early-extended.json").read_text())
    assert out["name"] == "dior-early-extended" and out["alias_moved"] and out["version"] == 1
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    detector = load_detector("dior-early-extended", tracking_uri=uri, llm=tiny_llm)
    assert detector.name == "dior-early-extended" and detector.groups == [
        "attribution",
        "entropy",
        "first_token",
        "hidden",
    ]
    # the registered model is the evaluated one: same probabilities as the evaluation stored
    scores = pd.read_parquet(pipeline / "data/eval/early_scores.parquet", columns=["id", "dior-early-extended"])
    rows = pd.read_parquet(pipeline / "data/early/early.parquet").merge(scores, on="id")
    np.testing.assert_allclose(detector.predict_proba(rows), rows["dior-early-extended"].to_numpy(), atol=1e-6)
    run = mlflow.get_run(out["run_id"])
    assert (
        run.data.params["detector"] == "dior-early-extended"
        and run.data.params["features"] == "attribution,entropy,first_token,hidden"
    )
    version = mlflow.MlflowClient().get_model_version("dior-early-extended", str(out["version"]))
    # only the same feature set competes for champion
    assert version.tags["features"] == "attribution,entropy,first_token,hidden"


def test_register_refuses_a_detector_that_was_not_trained_or_evaluated(pipeline_copy, tmp_path):
    """A register.detectors entry whose artifact or test metrics are missing is refused with what to do, before
    anything is registered (the other entries included)."""
    pipeline = pipeline_copy  # it runs the register stage (to be refused): its own copy, the working directory
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    entry = params["register"]["detectors"]["dior-early"]
    before = (pipeline / "data/registry/dior-early.json").read_text()
    for name, new, match in (
        (
            "dior-early-paper",
            entry | {"artifact": "data/models/early/dior-early-paper"},
            r"register.detectors.dior-early-paper.artifact = 'data/models/early/dior-early-paper': no trained "
            r"detector there \(trained beside it: \['dior-early', 'dior-early-extended', 'gru\[attribution\]'\]\)",
        ),
        (
            "dior-early-copy",
            entry | {"keys": ["question", "dior-early-paper"]},
            r"register.detectors.dior-early-copy.keys = \['question', 'dior-early-paper'\]: .* has no "
            r"'dior-early-paper' under \['question'\] \(there: \[.*'dior-early',",
        ),
    ):
        params["register"]["detectors"] = {"dior-early": entry, name: new}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        with pytest.raises(InputError, match=match):
            register_stage.main(["--params", str(tmp_path / "params.yaml")])
        with pytest.raises(InputError, match=r"--item \['dior-early-x'\]: not in register.detectors"):
            register_stage.main(["--params", str(tmp_path / "params.yaml"), "--item", "dior-early-x"])
    assert (pipeline / "data/registry/dior-early.json").read_text() == before  # nothing was registered


def test_pyfunc_model_predicts_from_questions(pipeline):
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)  # models:/ reads the registry: this store's, not the one an earlier test configured
    model = mlflow.pyfunc.load_model("models:/dior-early@champion")
    questions = ["The capital of Peru is", "The river of Paris is"]
    out = model.predict(pd.DataFrame({"question": questions}))
    assert list(out.columns) == ["probability", "retrieve", "keywords"]
    # the served model is the evaluated "dior-early": same probabilities as the evaluation stored for these questions
    early = pd.read_parquet(pipeline / "data/early/early.parquet")
    early = early.merge(pd.read_parquet(pipeline / "data/eval/early_scores.parquet"), on="id")
    stored = early.set_index("question").loc[questions, "dior-early"].to_numpy()
    np.testing.assert_allclose(out["probability"].to_numpy(), stored, atol=1e-5)


def test_detector_refuses_a_different_llm(pipeline, tokenizer):
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    other = LLM.wrap(build_tiny_llama(tokenizer, seed=1, train_steps=0), tokenizer, "another-tiny-llama")
    with pytest.raises(LLMMismatchError, match="weights_digest"):
        load_detector("dior-early", tracking_uri=uri, llm=other)


def test_the_champion_stays_unless_a_version_is_surely_better_on_the_same_validation_units(pipeline_copy, tmp_path):
    """Registering the same detectors again: each new version is level with its champion on the same validation
    questions (or answers), so it is registered as the challenger and the champion stays; the runs carry the choices
    training made and the seeds."""
    pipeline = pipeline_copy  # it registers new versions: its own copy, the working directory
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    params["paths"]["registry"] = str(tmp_path)  # the first registration's files stay
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    for name in ("dior-early", "dior-realtime"):  # as dvc.yaml runs it: one detector a run
        register_stage.main(["--params", str(tmp_path / "params.yaml"), "--item", name])
    assert {p.stem for p in tmp_path.glob("*.json")} == {"dior-early", "dior-realtime"}
    second = json.loads((tmp_path / "dior-early.json").read_text())
    early = pd.read_parquet(pipeline / "data/early/early.parquet")
    n_val = int(((early["status"] == "ok") & (early["split"] == "val")).sum())
    assert second["version"] == 2 and second["decision"] == "challenger" and second["champion_version"] == 1
    assert second["choice"]["ties"] == ["new"] and second["choice"]["deltas"]["new"][0] == 0
    assert second["choice"]["units"] == n_val and "is level with champion v1's" in second["reason"]
    client = mlflow.MlflowClient()
    assert int(client.get_model_version_by_alias("dior-early", "champion").version) == 1
    assert int(client.get_model_version_by_alias("dior-early", "challenger").version) == 2
    assert mlflow.get_run(second["run_id"]).data.tags["seeds"] == "0,1"  # the seeds of its ensemble
    realtime = json.loads((tmp_path / "dior-realtime.json").read_text())
    assert realtime["decision"] == "challenger" and realtime["choice"]["ties"] == ["new"]
    tags = mlflow.get_run(realtime["run_id"]).data.tags
    trained = json.loads((pipeline / "data/metrics/train_realtime.json").read_text())["mlp"]
    assert tags["choice.tokens.default"] == "all+answers" == trained["choice"]["default"]
    assert tags["choice.tokens.chosen"] == trained["tokens"] and tags["decision"] == "challenger"
    worse = register(  # a version without validation scores to pair is never compared: challenger too
        second["model_uri"],
        "dior-early",
        "champion",
        second["val_auroc"] + 0.1,
        second["val_digest"],
        second["llm_digest"],
    )
    assert worse["version"] == 3 and not worse["alias_moved"] and worse["champion_version"] == 1


def test_register_compares_the_realtime_detector_on_the_validation_records_training_scored(pipeline):
    """The real-time version is tagged with the digest training recorded: that of the ok validation records of the set
    it was chosen on (here the QA answers with a token), which the champion rule compares."""
    from detectors.dior.realtime_detector import answer_records

    out = json.loads((pipeline / "data/registry/dior-realtime.json").read_text())
    trained = json.loads((pipeline / "data/models/realtime/detector.json").read_text())["info"]
    answers = answer_records(pd.read_parquet(pipeline / "data/early/early.parquet"))
    assert trained["chosen_on"] == "answers" and out["val_digest"] == trained["val_digest"]
    assert out["val_digest"] == validation_digest(answers.loc[answers["split"] == "val", "id"])
    version = mlflow.MlflowClient(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}").get_model_version(
        "dior-realtime", str(out["version"])
    )
    assert version.tags["val_digest"] == out["val_digest"]


def test_register_refuses_a_detector_without_its_validation_records():
    for info in ({"chosen_on": "answers"}, {"chosen_on": "continuations", "val_digest": None, "validation": None}):
        with pytest.raises(
            InputError, match=r"records no validation records \(info.val_digest, info.validation\).*retrain it"
        ):
            register_stage.validation_digest(info, "data/models/realtime")
    assert register_stage.validation_digest({"val_digest": "0123abcd"}, "data/models/realtime") == "0123abcd"
    ids = {"ids": ["b", "a"], "labels": [0, 1], "scores": [0.1, 0.9]}
    assert register_stage.validation_digest({"validation": ids}, "x") == validation_digest(["a", "b"])


def test_comparison_notebook_runs_on_the_store(pipeline):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "compare_detectors.ipynb", as_version=4)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    try:
        nbclient.NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(pipeline)}}
        ).execute()
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    outputs = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells for o in c.get("outputs", [])
    )
    mlflow.set_tracking_uri(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["detector-evaluation-early", "detector-evaluation-realtime"])
    # a table per set × level, every scorer in it
    for dataset, level in set(zip(runs["tags.dataset"], runs["tags.level"])):
        assert f"{dataset} set, {level} level" in outputs
    assert set(runs["tags.detector"]) <= set(outputs.split()) and "(not described here)" not in outputs
    assert "ΔAUROC" in outputs or "no paired differences" in outputs
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    client = mlflow.MlflowClient()
    figures = {Path(a.path).name for run_id in runs["run_id"] for a in client.list_artifacts(run_id, "plots")}
    assert figures and len(images) == 1 + len(figures)  # the AUROC bars and every figure logged with the runs


def test_realtime_set_reports_bad_articles_and_has_both_labels(pipeline):
    articles = json.loads((pipeline / "data/articles/articles_report.json").read_text())
    assert articles["rejected_reasons"] == {"empty text": 1, "duplicate title": 1}
    report = json.loads((pipeline / "data/realtime/report.json").read_text())
    assert report["records"] == 50 and report["warnings"] == 1  # the long article was cut
    frame = pd.read_parquet(pipeline / "data/realtime/realtime.parquet")
    weather = frame[frame["title"] == "Weather"].iloc[0]
    assert "no entity" in weather["status"]
    ok = frame[frame["status"] == "ok"]
    for split in ("train", "val"):
        tokens = np.concatenate([np.asarray(t) for t in ok.loc[ok["split"] == split, "token_label"]])
        assert set(tokens) == {-1, 0, 1}, split
    hidden = load_file(str(pipeline / "data/realtime/hidden.safetensors"))["hidden"]
    assert hidden.dtype == np.float16 and hidden.shape == (sum(len(g) for g in ok["gen_ids"]), 2 * 64)
    for row in ok.itertuples():
        assert len(row.prob) == len(row.entropy) == len(row.token_label) == len(row.gen_ids) <= 6
        assert row.label == int(any(e["hallucinated"] for e in json.loads(row.entities)))


def test_build_realtime_resumes_without_redoing_finished_shards(pipeline_copy):
    pipeline = pipeline_copy  # it deletes and rebuilds the real-time set: its own copy, the working directory
    shards = sorted((pipeline / "data/realtime/shards").glob("shard-*.parquet"))
    before = pd.read_parquet(pipeline / "data/realtime/realtime.parquet")
    hidden = load_file(str(pipeline / "data/realtime/hidden.safetensors"))["hidden"]
    stamps = {p.name: p.stat().st_mtime_ns for p in shards[:-1]}
    shards[-1].unlink()
    build_realtime.main(["--params", "params.yaml"])
    assert {p.name: p.stat().st_mtime_ns for p in shards[:-1]} == stamps
    after = pd.read_parquet(pipeline / "data/realtime/realtime.parquet")
    pd.testing.assert_frame_equal(before.drop(columns=["prob", "entropy"]), after.drop(columns=["prob", "entropy"]))
    ok = before["status"] == "ok"
    np.testing.assert_allclose(
        np.concatenate(before.loc[ok, "prob"].tolist()), np.concatenate(after.loc[ok, "prob"].tolist()), atol=1e-5
    )
    np.testing.assert_allclose(
        load_file(str(pipeline / "data/realtime/hidden.safetensors"))["hidden"], hidden, atol=1e-2
    )


def test_realtime_evaluation_at_three_levels(pipeline):
    metrics = json.loads((pipeline / "data/metrics/evaluate_realtime.json").read_text())
    assert set(metrics) == {"token", "entity", "continuation"}
    assert {"mlp", "flare", "token_entropy"} <= set(metrics["token"])
    assert {"mlp", "sit_min", "sit_avg", "sit_norm", "token_entropy"} <= set(metrics["entity"])
    assert {"mlp", "flare", "sit_min", "sit_avg", "sit_norm", "token_entropy"} <= set(metrics["continuation"])
    scores = pd.read_parquet(pipeline / "data/eval/realtime_scores.parquet")
    for level, by_scorer in metrics.items():
        test = scores[(scores["level"] == level) & (scores["split"] == "test")]
        for name, m in by_scorer.items():  # the metrics are those of the stored test-split scores at that level
            assert m["n"] == len(test) and m["auroc"] == pytest.approx(auroc(test["label"], test[name]), abs=1e-6), (
                level,
                name,
            )
    assert {p.stem for p in (pipeline / "data/plots/roc/realtime_entity").glob("*.csv")} == set(metrics["entity"])
    runs = evaluation_runs(pipeline, "realtime")  # one flat run per scorer and level
    assert sorted(zip(runs["tags.level"], runs["tags.detector"])) == sorted(
        (lv, n) for lv, by in metrics.items() for n in by
    )
    mlp = runs[(runs["tags.detector"] == "mlp") & (runs["tags.level"] == "continuation")].iloc[0]
    assert mlp["metrics.test_auroc"] == pytest.approx(metrics["continuation"]["mlp"]["auroc"])


def test_registered_realtime_detector_scores_generation_as_stored(pipeline, tiny_llm):
    out = json.loads((pipeline / "data/registry/dior-realtime.json").read_text())
    assert out["name"] == "dior-realtime" and out["alias_moved"]
    # versions compete on what is served: the validation AUROC of the max over every generated token, and its test one
    trained = json.loads((pipeline / "data/metrics/train_realtime.json").read_text())["mlp"]
    served = json.loads((pipeline / "data/metrics/evaluate_realtime.json").read_text())["continuation"]["mlp[served]"]
    # four candidate training sets, chosen on the QA validation answers, each reported on both sets
    assert trained["chosen_on"] == "answers" and set(trained["candidates"]) == {
        "entity",
        "all",
        "answers",
        "all+answers",
    }
    assert all(set(c["served_auroc"]) == {"continuations", "answers"} for c in trained["candidates"].values())
    assert out["val_auroc"] == pytest.approx(trained["val_served_auroc"])  # (equal to the token AUROC on this tiny set)
    assert out["test_auroc"] == pytest.approx(served["auroc"])
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    detector = load_detector("dior-realtime", tracking_uri=uri, llm=tiny_llm)
    frame = pd.read_parquet(pipeline / "data/realtime/realtime.parquet")
    row = frame[frame["status"] == "ok"].iloc[0]
    text = tiny_llm.tokenizer.decode(row["prompt_ids"])
    with detector.monitor() as mon:
        tiny_llm.model.generate(
            torch.tensor([list(row["prompt_ids"])]), logits_processor=[mon], max_new_tokens=7, do_sample=False
        )
    result = detector.result(mon)
    assert result.text.startswith(row["continuation"]) and text
    # the tokens the pipeline labelled get the same probability online as in the evaluation
    scores = pd.read_parquet(pipeline / "data/eval/realtime_scores.parquet")
    tokens = scores[(scores["level"] == "token") & scores["id"].str.startswith(row["id"] + ":")]
    for token_id, mlp in zip(tokens["id"], tokens["mlp"]):
        assert result.probabilities[int(token_id.split(":")[1])] == pytest.approx(mlp, abs=1e-4)
    model = mlflow.pyfunc.load_model("models:/dior-realtime@champion")
    pred = model.predict(pd.DataFrame({"title": ["capital of Peru"], "text": ["The capital of Peru is"]}))
    assert {"text", "probabilities", "trigger", "keywords"} <= set(pred.columns)


def test_ctrla_directions_are_extracted_evaluated_registered_and_served(pipeline_copy, tiny_llm, tokenizer):
    """extract_directions → evaluate_directions → register_ctrla on the tiny Llama, then both served kinds."""
    from detectors.ctrla.registered import ConfidenceDetector, HonestySteering
    from pipelines import evaluate_directions, extract_directions, register_ctrla

    pipeline = pipeline_copy  # it runs the CtrlA stages and registers: its own copy, the working directory
    run_ctrla_stages(pipeline, (extract_directions, evaluate_directions, register_ctrla), "params_ctrla.yaml")

    extracted = json.loads((pipeline / "data/metrics/extract_directions.json").read_text())
    assert extracted["honesty"]["layers"] == [1] and extracted["confidence"]["layers"] == [1, 2]
    assert set(extracted["honesty"]["size_curve_cosine"]) == {"4", "8"}
    metrics = json.loads((pipeline / "data/metrics/evaluate_directions.json").read_text())
    honesty = metrics["honesty"]
    assert len(honesty["auroc_per_layer"]) == 2 and honesty["ranges"]["paper"]["layers"] == [1]
    assert honesty["ranges"]["paper"]["test_auroc"] == honesty["auroc_per_layer"][0]  # the paper's range is layer 1
    # the rule: the paper's range unless the other layer is surely better on the val statements (a tie keeps it)
    chosen, choice = honesty["ranges"]["validation"]["layers"], honesty["ranges"]["validation"]["choice"]
    assert choice["default"] == "1-1" and choice["chosen"] == f"{chosen[0]}-{chosen[-1]}" and len(chosen) == 1
    assert choice["units"] == honesty["n_val"] and (chosen == [1]) == (choice["better"] == [])
    assert honesty["ranges"]["validation"]["test_auroc"] == honesty["auroc_per_layer"][chosen[0] - 1]
    confidence = metrics["confidence_early"]["ranges"]
    choice = confidence["validation"]["choice"]  # windows of one layer against the paper's two
    assert confidence["paper"]["layers"] == [1, 2] and choice["default"] == "1-2"
    assert set(choice["ties"] + choice["better"] + choice["worse"]) == {"1-1", "2-2"}
    moved = confidence["validation"]["layers"] != [1, 2]
    assert moved == (choice["chosen"] != "1-2") == bool(choice["better"])
    for name in ("paper", "validation"):  # each range keeps its val scores for the registry's champion rule
        assert len(confidence[name]["validation"]["scores"]) == choice["units"]
    for rates in (confidence["paper"], confidence["validation"], *metrics["confidence_realtime"]["ranges"].values()):
        assert all(0 <= v <= 1 for k, v in rates.items() if "trigger_rate" in k and v is not None)
    assert set(metrics["truthfulqa"]["accuracy"]) == {"0.0", "0.05"} and metrics["truthfulqa"]["n"] == 3
    page = (pipeline / "docs/results/directions.md").read_text()  # the results page the README's CtrlA claims cite
    assert "| honesty: true vs false statements (test statements) | paper | 1-1 | " in page
    assert f"{honesty['ranges']['paper']['test_auroc']:.3f} |" in page and "| 0.05 |" in page
    early = pd.read_parquet(pipeline / "data/early/early.parquet")
    scores = pd.read_parquet(pipeline / "data/eval/ctrla_early.parquet")
    assert list(scores["id"]) == list(early.loc[early["status"] == "ok", "id"])
    assert (
        list(scores.columns) == ["id", "ctrla_confidence", "ctrla_confidence[val-layers]"]
        and np.isfinite(scores.iloc[:, 1:]).all().all()
    )
    realtime = pd.read_parquet(pipeline / "data/eval/ctrla_realtime.parquet")
    assert list(realtime.columns) == ["id", "ctrla_confidence", "ctrla_confidence[val-layers]"]
    frame = pd.read_parquet(pipeline / "data/realtime/realtime.parquet").set_index("id")
    assert all(
        len(s) == len(frame.loc[i, "gen_ids"]) for i, s in zip(realtime["id"], realtime["ctrla_confidence[val-layers]"])
    )
    assert (pipeline / "data/plots/ctrla_honesty_layers.csv").exists() and (
        pipeline / "data/plots/ctrla_truthfulqa.png"
    ).exists()

    registered = json.loads((pipeline / "data/registry/ctrla.json").read_text())
    assert registered["honesty"]["name"] == "ctrla-honesty" and registered["confidence"]["alias_moved"]
    # params: confidence_layers: validation
    assert registered["confidence"]["layers"] == confidence["validation"]["layers"]
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    honesty = load_detector("ctrla-honesty", tracking_uri=uri, llm=tiny_llm)
    confidence = load_detector("ctrla-confidence", tracking_uri=uri, llm=tiny_llm)
    assert isinstance(honesty, HonestySteering) and isinstance(confidence, ConfidenceDetector)
    assert confidence.directions.layers == registered["confidence"]["layers"] and honesty.directions.layers == chosen
    if moved:  # an artifact at other layers than the paper's records where they came from
        assert confidence.directions.config["layer_selection"] == {"range": "validation", "paper_layers": [1, 2]}
    segment = confidence.generate("The capital of Spain is", steering=honesty, max_new_tokens=4)
    assert len(segment.scores) == len(segment.token_ids) and segment.query.startswith("The capital of Spain is")
    ids = tiny_llm.tokenizer("The capital of Spain is", return_tensors="pt")["input_ids"]
    with honesty.steer(), confidence.monitor() as monitor:
        tiny_llm.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert monitor.scores().shape[1] >= ids.shape[1]
    mlflow.set_tracking_uri(uri)
    out = mlflow.pyfunc.load_model("models:/ctrla-confidence@champion").predict(
        pd.DataFrame({"question": ["The capital of Peru is"]})
    )
    assert {"text", "scores", "retrieve", "refusal", "query"} <= set(out.columns)
    other = LLM.wrap(build_tiny_llama(tokenizer, seed=1, train_steps=0), tokenizer, "another-tiny-llama")
    with pytest.raises(LLMMismatchError, match="weights_digest"):
        load_detector("ctrla-honesty", tracking_uri=uri, llm=other)
