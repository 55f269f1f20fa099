"""Early-detection features of one question, on the tiny Llama."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from detectors.config.schema import EarlyFeatureParams, PromptParams
from detectors.dior.early import features_to_row, question_features, scalar_features, vector_features
from detectors.errors import RecordError

PARAMS = EarlyFeatureParams(prompt=PromptParams(template="{question}", chat=False), n_steps=4, hidden_layers=[1, -1])


def test_features_of_a_question(tiny_llm):
    f = question_features(tiny_llm, "The capital of Egypt is", PARAMS)
    assert len(f.attribution) == len(f.question_tokens) == int(tiny_llm.encode_prompt("The capital of Egypt is", PARAMS.prompt)[1].sum())
    assert f.attribution.sum() == pytest.approx(1.0, abs=1e-5)
    assert 0 <= f.entropy <= np.log(len(f.attribution)) + 1e-9
    assert f.keywords and set(f.keywords) <= {"The", "capital", "of", "Egypt", "is"}
    # Egypt is a memorised fact (conftest.known_facts): the next-token distribution is sure of Cairo's first token
    with torch.no_grad():
        logits = tiny_llm.model(tiny_llm.encode_prompt("The capital of Egypt is", PARAMS.prompt)[0]).logits[0, -1]
    top2 = torch.softmax(logits, -1).topk(2)
    assert f.first_token_id == int(top2.indices[0]) and "Cairo".startswith(tiny_llm.tokenizer.decode([f.first_token_id]).strip())
    assert f.first_token_prob == pytest.approx(float(top2.values[0]), abs=1e-5) and f.first_token_prob > 0.9
    assert f.first_token_margin == pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-5)
    assert f.hidden.shape == (2 * 64,)
    again = question_features(tiny_llm, "The capital of Egypt is", PARAMS)
    np.testing.assert_array_equal(f.attribution, again.attribution)


def test_bad_questions_are_record_errors(tiny_llm):
    with pytest.raises(RecordError, match="empty question"):
        question_features(tiny_llm, "  ", PARAMS)
    with pytest.raises(RecordError, match="max_question_tokens=3"):
        question_features(tiny_llm, "The capital of the United Kingdom of Great Britain is", dataclasses.replace(PARAMS, max_question_tokens=3))


def test_layer_out_of_range_names_the_key(tiny_llm):
    with pytest.raises(ValueError, match="hidden_layers has 5, but the LLM has 2 layers"):
        question_features(tiny_llm, "The capital of Egypt is", dataclasses.replace(PARAMS, hidden_layers=[5]))


def test_per_question_features_follow_the_groups(tiny_llm):
    row = features_to_row(question_features(tiny_llm, "The capital of Peru is", PARAMS))
    assert scalar_features(row, ["entropy"]).shape == (3,)
    assert scalar_features(row, ["entropy", "first_token", "hidden"]).shape == (3 + 4,)
    assert vector_features(row, ["entropy", "first_token", "hidden"]).shape == (128,)
    assert scalar_features(row, ["attribution"]).shape == vector_features(row, ["attribution"]).shape == (0,)


def test_greedy_answer_matches_generate_and_stops_at_the_stop_string(tiny_llm):
    from detectors.dior.early import greedy_answer

    for question in ("The capital of Spain is", "The river of Cairo is", "The sport of Bolt is"):
        f = question_features(tiny_llm, question, PARAMS)
        ids, _ = tiny_llm.encode_prompt(question, PARAMS.prompt)
        ref = tiny_llm.model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tiny_llm.tokenizer.pad_token_id)
        expected = tiny_llm.tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
        assert greedy_answer(tiny_llm, f, 5) == expected.strip()
        cut = greedy_answer(tiny_llm, question_features(tiny_llm, question, PARAMS), 5, stop=["."])
        assert cut == expected.split(".", 1)[0].strip() and "." not in cut


BATCH = [
    "The capital of Spain is",
    "  ",  # unusable: its RecordError takes its place, the others go on
    "The river of Cairo is",
    "The sport of Bolt is",
    "The capital of the United Kingdom of Great Britain and Northern Ireland is",  # the longest: padding for the rest
    "The capital of Egypt is",
]
FEW_SHOT = PromptParams(template="The capital of France is Paris.\n{question}", chat=False)


@pytest.mark.parametrize("prompt", [PARAMS.prompt, FEW_SHOT])  # without / with a shared prefix before the questions
@pytest.mark.parametrize("rows", [3, 64])  # a question's IG steps split across passes / several questions per pass
def test_a_batch_of_questions_equals_each_question_alone(tiny_llm, prompt, rows):
    from detectors.dior.early import batch_question_features, early_records, greedy_answer, greedy_answers

    params = dataclasses.replace(PARAMS, prompt=prompt, ig_batch_size=rows)
    batch = batch_question_features(tiny_llm, BATCH, params)
    assert isinstance(batch[1], RecordError) and "empty question" in str(batch[1])
    usable = [f for f in batch if not isinstance(f, RecordError)]
    answers = greedy_answers(tiny_llm, usable, 6, stop=["\n"])
    alone = [question_features(tiny_llm, q, dataclasses.replace(params, ig_batch_size=4)) for q in BATCH if q.strip()]
    for f, a, answer in zip(usable, alone, answers):
        assert f.question_tokens == a.question_tokens and f.first_token_id == a.first_token_id
        np.testing.assert_allclose(f.attribution, a.attribution, atol=1e-6)
        # hidden state and first-token probability come from one padded fp32 pass: the kernels for the
        # padded shape round differently by CPU (1.5e-6 on an AMD EPYC), so both get the same 1e-5
        np.testing.assert_allclose(f.hidden, a.hidden, atol=1e-5)
        assert f.first_token_prob == pytest.approx(a.first_token_prob, abs=1e-5)
        assert answer == greedy_answer(tiny_llm, a, 6, stop=["\n"])  # padded rows decode as the question alone
    records = early_records(tiny_llm, BATCH, [["Madrid"], [], ["Nile"], ["athletics"], ["London"], ["Cairo"]], params, 6, ["\n"])
    assert isinstance(records[1], RecordError) and [r["answer"] for r in records if isinstance(r, dict)] == answers
    assert records[5]["label"] == int("Cairo" not in answers[-1])


def test_answers_continue_one_batch_only(tiny_llm):
    from detectors.dior.early import batch_question_features, greedy_answers

    a = batch_question_features(tiny_llm, BATCH[:1], PARAMS)[0]
    b = batch_question_features(tiny_llm, BATCH[2:3], PARAMS)[0]
    with pytest.raises(ValueError, match="one batch_question_features call"):
        greedy_answers(tiny_llm, [a, b], 4)
