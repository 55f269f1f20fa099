"""What an artifact records of its LLM, on the tiny Llama: the dtype its features were computed in (serving in
another one is refused unless allowed) and where the LLM came from, relative to the project (it can move)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import qa_rows

from detectors.config.schema import EarlyFeatureParams, PromptParams, RealtimePromptParams, TrainingParams
from detectors.dior.early import early_records
from detectors.dior.early_detector import EarlyDetector, train_early_detector
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.llm.fingerprint import DtypeMismatchError
from detectors.llm.loading import LLM, prepare_llm, prepared_reference
from detectors.registry.artifact import seal

FEATURES = EarlyFeatureParams(
    prompt=PromptParams(template="{question}", chat=False), n_steps=4, ig_batch_size=4, hidden_layers=[1, -1]
)
TRAINING = TrainingParams(
    hidden=8,
    dropout=0.0,
    lr=3e-3,
    weight_decay=1e-2,
    batch_size=8,
    max_epochs=8,
    patience=4,
    threshold="youden",
    seed=0,
    accelerator="cpu",
)


def in_bfloat16(llm: LLM) -> LLM:
    return LLM.wrap(copy.deepcopy(llm.model).to(torch.bfloat16), llm.tokenizer, llm.fingerprint.name)


@pytest.fixture(scope="module")
def early(tiny_llm) -> EarlyDetector:
    """An early detector trained on the tiny Llama's real fp32 features of the QA fixture (as build_early stores
    them)."""
    rows, qa = [], qa_rows()
    records = early_records(tiny_llm, [r["question"] for r in qa], [r["answers"] for r in qa], FEATURES, 4, [])
    for i, record in enumerate(records):
        split = ("train", "val", "test")[i % 3]
        rows.append({"id": f"q{i}", "split": split, "status": "ok", "feature_dtype": tiny_llm.dtype_name, **record})
    return train_early_detector(
        pd.DataFrame(rows),
        ["attribution", "entropy", "first_token", "hidden"],
        TRAINING,
        FEATURES,
        tiny_llm.fingerprint,
        {"source": "tiny"},
    )


def test_serving_in_another_dtype_is_refused_unless_allowed(early, tiny_llm, tmp_path):
    loaded = EarlyDetector.load(early.save(tmp_path / "early"))
    assert loaded.feature_dtype == "float32"
    assert json.loads((tmp_path / "early" / "detector.json").read_text())["llm"]["dtype"] == "float32"
    bf16 = in_bfloat16(tiny_llm)
    assert bf16.fingerprint == tiny_llm.fingerprint  # the fingerprint cannot tell: it rounds weights to bf16 on purpose
    refused = (
        r"'dior-early': built from float32 features, .* computes bfloat16 .* dtype='float32'.*allow_dtype_mismatch=True"
    )
    with pytest.raises(DtypeMismatchError, match=refused):
        loaded.attach(bf16)
    assert loaded.llm is None
    questions = [r["question"] for r in qa_rows()]
    fp32 = np.array([loaded.attach(tiny_llm).assess(q).probability for q in questions])
    served = np.array([loaded.attach(bf16, allow_dtype_mismatch=True).assess(q).probability for q in questions])
    diff = np.abs(fp32 - served)
    # measured: max 0.0024, mean 0.0005 over the 48 questions (1 retrieve decision of 48 flips at the threshold)
    assert 1e-4 < diff.max() < 0.2, diff.max()


def test_an_artifact_without_a_recorded_dtype_is_served_with_a_warning(early, tiny_llm, tmp_path):
    early.save(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "detector.json").read_text())
    del config["llm"]["dtype"]  # as written before dtypes were recorded
    (tmp_path / "old" / "detector.json").write_text(json.dumps(config))
    seal(tmp_path / "old")  # its files' digests, as its writer records them
    old = EarlyDetector.load(tmp_path / "old")
    assert old.feature_dtype is None
    with pytest.warns(UserWarning, match="records no feature dtype .* served with bfloat16 features"):
        old.attach(in_bfloat16(tiny_llm))


def tiny_realtime(fingerprint, llm_ref) -> RealtimeDetector:
    dim = fingerprint.hidden_size + 3
    return RealtimeDetector(
        TokenMLP(dim, 4, 0.0).eval(),
        np.zeros(dim, np.float32),
        np.ones(dim, np.float32),
        0.5,
        [1],
        [1],
        RealtimePromptParams(template="{text}", chat=False),
        "en_core_web_sm",
        fingerprint,
        llm_ref,
        {},
    )


@pytest.fixture()
def project(tmp_path, tiny_llm):
    """A project with the tiny Llama's checkpoint inside it, prepared into data/llm as the prepare stage does
    (the source given as an absolute path); the working directory is the project while the test runs."""
    root = tmp_path / "project"
    (root / "models").mkdir(parents=True)
    tiny_llm.model.save_pretrained(root / "models" / "tiny", safe_serialization=True)
    tiny_llm.tokenizer.save_pretrained(root / "models" / "tiny")
    previous = Path.cwd()
    os.chdir(root)
    try:
        prepare_llm(str(root / "models" / "tiny"), "data/llm")
        yield root
    finally:
        os.chdir(previous)


def test_a_detectors_llm_loads_after_the_project_moved(project, tmp_path, tiny_llm):
    fingerprint, ref = prepared_reference("data/llm")
    assert ref["dir"] == "data/llm" and ref["source"] == "models/tiny"
    tiny_realtime(fingerprint, {**ref, "dtype": "float32"}).save("data/models/realtime")
    for written in ("data/models/realtime/detector.json", "data/llm/llm.json"):
        assert str(project) not in Path(written).read_text() and str(project.resolve()) not in Path(written).read_text()
    moved = shutil.move(project, tmp_path / "moved")
    os.chdir(moved)
    llm = RealtimeDetector.load("data/models/realtime").load_llm(device="cpu")
    assert llm.fingerprint.weights_digest == tiny_llm.fingerprint.weights_digest
    os.chdir(tmp_path)  # elsewhere: the project root is passed instead
    detector = RealtimeDetector.load(Path(moved) / "data/models/realtime")
    with pytest.raises(RuntimeError, match="run from the project root or pass root="):
        detector.load_llm(device="cpu")
    assert detector.load_llm(device="cpu", root=moved).fingerprint == llm.fingerprint
    shutil.rmtree(Path(moved) / "data/llm")  # the recorded source is the fallback
    assert detector.load_llm(device="cpu", root=moved).fingerprint.weights_digest == tiny_llm.fingerprint.weights_digest


def test_the_llm_loads_in_the_recorded_dtype_by_default(project):
    fingerprint, ref = prepared_reference("data/llm")
    detector = tiny_realtime(fingerprint, {**ref, "dtype": "bfloat16"})
    assert detector.load_llm(device="cpu").dtype_name == "bfloat16"  # not auto's float32 on CPU
    with pytest.raises(DtypeMismatchError, match="built from bfloat16 features, .* computes float32"):
        detector.load_llm(dtype="float32", device="cpu")
    assert detector.load_llm(dtype="float32", device="cpu", allow_dtype_mismatch=True).dtype_name == "float32"
