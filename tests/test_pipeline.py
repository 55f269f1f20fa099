"""The whole DAG on the tiny Llama and the hand-made QA fixture: prepare → build_early → train_early →
evaluate → register, then the registered detector loaded back through the inference module."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import QA_FIXTURE, ROOT, build_tiny_llama
from detectors import load_detector
from detectors.llm import LLM, LLMMismatchError
from detectors.registry import register
from pipelines import build_early, evaluate, prepare, train_early
from pipelines import register as register_stage


def write_params(workdir: Path, checkpoint: Path) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["llm"].update(source=str(checkpoint), dtype="float32", device="cpu")
    params["qa"].update(source=str(QA_FIXTURE), limit=None, splits={"train": 0.5, "val": 0.25, "test": 0.25})
    params["build_early"]["features"].update(n_steps=4, ig_batch_size=4, hidden_layers=[1, -1])
    params["build_early"]["features"]["prompt"].update(template="{question}", chat=False)  # as the tiny Llama learnt them
    params["build_early"].update(max_new_tokens=4, shard_size=8)
    params["train_early"].update(ablation=[["attribution"]], max_epochs=15, patience=5, batch_size=8, accelerator="cpu")
    path = workdir / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_checkpoint):
    """Run every stage once in a fresh directory; yields that directory."""
    workdir = tmp_path_factory.mktemp("pipeline")
    previous = Path.cwd()
    os.chdir(workdir)
    try:
        write_params(workdir, tiny_checkpoint)
        for stage in (prepare, build_early, train_early, evaluate, register_stage):
            stage.main(["--params", "params.yaml"])
        yield workdir
    finally:
        os.chdir(previous)


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
    # memorised facts are answered correctly far more often than the others
    report = json.loads((pipeline / "data/early/report.json").read_text())
    assert 0 < report["hallucination_rate"] < 1


def test_build_early_resumes_without_redoing_finished_shards(pipeline):
    os.chdir(pipeline)
    shards = sorted((pipeline / "data/early/shards").glob("shard-*.parquet"))
    before = pd.read_parquet(pipeline / "data/early/early.parquet")
    stamps = {p.name: p.stat().st_mtime_ns for p in shards[:-1]}
    shards[-1].unlink()  # as if the run had been killed during the last shard
    (pipeline / "data/early/early.parquet").unlink()
    build_early.main(["--params", "params.yaml"])
    assert {p.name: p.stat().st_mtime_ns for p in shards[:-1]} == stamps
    after = pd.read_parquet(pipeline / "data/early/early.parquet")
    pd.testing.assert_frame_equal(before.drop(columns=["attribution", "hidden"]), after.drop(columns=["attribution", "hidden"]))
    np.testing.assert_allclose(np.concatenate(before["attribution"]), np.concatenate(after["attribution"]), atol=1e-6)


def test_evaluate_writes_same_metrics_for_every_scorer(pipeline):
    metrics = json.loads((pipeline / "data/metrics/evaluate_early.json").read_text())
    assert {"gru", "gru[attribution]", "logreg[attribution+first_token]", "attribution_entropy", "first_token_prob",
            "first_token_entropy"} <= set(metrics)
    keys = {"auroc", "auroc_ci_low", "auroc_ci_high", "auprc", "accuracy", "f1", "ece", "threshold"}
    for name, m in metrics.items():
        assert keys <= set(m), name
        assert 0 <= m["auroc_ci_low"] <= m["auroc"] <= m["auroc_ci_high"] <= 1 and 0 <= m["ece"] <= 1
    assert (pipeline / "data/plots/early_roc.png").stat().st_size > 0
    assert (pipeline / "data/plots/early_roc/gru.csv").exists()
    assert {p.name for p in (pipeline / "data/plots/early_entropy_ecdf").glob("*.csv")} == {"correct.csv", "hallucinated.csv"}
    mlflow.set_tracking_uri(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["detector-evaluation"], filter_string="tags.kind != ''")
    assert set(runs["params.scorer"]) == set(metrics)
    assert runs["metrics.test_auroc"].notna().all()


def test_registered_detector_serves_the_features_it_was_trained_on(pipeline, tiny_llm):
    registry_out = json.loads((pipeline / "data/registry/dior-early.json").read_text())
    assert registry_out["version"] == 1 and registry_out["alias_moved"]
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    detector = load_detector("dior-early", alias="champion", tracking_uri=uri, llm=tiny_llm)
    frame = pd.read_parquet(pipeline / "data/early/early.parquet")
    row = frame[frame["question"] == "The capital of Spain is"].iloc[0]
    decision = detector.assess("The capital of Spain is")
    # serving recomputes the features with the same code: same attribution, same probability
    np.testing.assert_allclose(decision.attribution, row["attribution"], atol=1e-5)
    stored = detector.predict_rows([row.to_dict()])[0]
    assert decision.probability == pytest.approx(float(stored), abs=1e-5)
    assert decision.retrieve == (decision.probability >= detector.threshold)
    assert set(decision.keywords) <= {"The", "capital", "of", "Spain", "is"} and decision.keywords


def test_pyfunc_model_predicts_from_questions(pipeline):
    mlflow.set_tracking_uri(f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/dior-early@champion")
    out = model.predict(pd.DataFrame({"question": ["The capital of Peru is", "The river of Paris is"]}))
    assert list(out.columns) == ["probability", "retrieve", "keywords"]
    assert out["probability"].between(0, 1).all()


def test_detector_refuses_a_different_llm(pipeline, tokenizer):
    uri = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    other = LLM.wrap(build_tiny_llama(tokenizer, seed=1, train_steps=0), tokenizer, "another-tiny-llama")
    with pytest.raises(LLMMismatchError, match="weights_digest"):
        load_detector("dior-early", tracking_uri=uri, llm=other)


def test_champion_alias_moves_only_when_not_worse(pipeline):
    os.chdir(pipeline)
    register_stage.main(["--params", "params.yaml"])  # same detector again: equal AUROC → alias moves
    second = json.loads((pipeline / "data/registry/dior-early.json").read_text())
    assert second["version"] == 2 and second["alias_moved"] and second["champion_version"] == 2
    worse = register(second["model_uri"], "dior-early", "champion", val_auroc=second["val_auroc"] - 0.1)
    assert worse["version"] == 3 and not worse["alias_moved"] and worse["champion_version"] == 2
    client = mlflow.MlflowClient()
    assert int(client.get_model_version_by_alias("dior-early", "champion").version) == 2


def test_comparison_notebook_runs_on_the_store(pipeline):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "compare_detectors.ipynb", as_version=4)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{pipeline / 'data/mlflow/mlflow.db'}"
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(pipeline)}}).execute()
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    outputs = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells for o in c.get("outputs", []))
    assert "gru" in outputs and "attribution_entropy" in outputs
