"""Early-detection features of one question, on the tiny Llama."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from detectors.config.schema import EarlyFeatureParams, PromptParams
from detectors.dior.early import features_to_row, question_features, scalar_features, vector_features
from detectors.errors import RecordError

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PARAMS = EarlyFeatureParams(prompt=PromptParams(template="{question}", chat=False), n_steps=4, hidden_layers=[1, -1])


def test_features_of_a_question(tiny_llm):
    f = question_features(tiny_llm, "The capital of Egypt is", PARAMS)
    assert (
        len(f.attribution)
        == len(f.question_tokens)
        == int(tiny_llm.encode_prompt("The capital of Egypt is", PARAMS.prompt)[1].sum())
    )
    assert f.attribution.sum() == pytest.approx(1.0, abs=1e-5)
    assert 0 <= f.entropy <= np.log(len(f.attribution)) + 1e-9
    assert f.keywords and set(f.keywords) <= {"The", "capital", "of", "Egypt", "is"}
    # Egypt is a memorised fact (conftest.known_facts): the next-token distribution is sure of Cairo's first token
    with torch.no_grad():
        logits = tiny_llm.model(tiny_llm.encode_prompt("The capital of Egypt is", PARAMS.prompt)[0]).logits[0, -1]
    top2 = torch.softmax(logits, -1).topk(2)
    assert f.first_token_id == int(top2.indices[0]) and "Cairo".startswith(
        tiny_llm.tokenizer.decode([f.first_token_id]).strip()
    )
    assert f.first_token_prob == pytest.approx(float(top2.values[0]), abs=1e-5) and f.first_token_prob > 0.9
    assert f.first_token_margin == pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-5)
    assert f.hidden.shape == (2 * 64,)
    again = question_features(tiny_llm, "The capital of Egypt is", PARAMS)
    np.testing.assert_array_equal(f.attribution, again.attribution)


def test_bad_questions_are_record_errors(tiny_llm):
    with pytest.raises(RecordError, match="empty question"):
        question_features(tiny_llm, "  ", PARAMS)
    with pytest.raises(RecordError, match="max_question_tokens=3"):
        question_features(
            tiny_llm,
            "The capital of the United Kingdom of Great Britain is",
            dataclasses.replace(PARAMS, max_question_tokens=3),
        )


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
        ref = tiny_llm.model.generate(
            ids, max_new_tokens=5, do_sample=False, pad_token_id=tiny_llm.tokenizer.pad_token_id
        )
        expected = tiny_llm.tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
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
    records = early_records(
        tiny_llm, BATCH, [["Madrid"], [], ["Nile"], ["athletics"], ["London"], ["Cairo"]], params, 6, ["\n"]
    )
    assert isinstance(records[1], RecordError) and [r["answer"] for r in records if isinstance(r, dict)] == answers
    assert records[5]["label"] == int("Cairo" not in answers[-1])


def test_answers_continue_one_batch_only(tiny_llm):
    from detectors.dior.early import batch_question_features, greedy_answers

    a = batch_question_features(tiny_llm, BATCH[:1], PARAMS)[0]
    b = batch_question_features(tiny_llm, BATCH[2:3], PARAMS)[0]
    with pytest.raises(ValueError, match="one batch_question_features call"):
        greedy_answers(tiny_llm, [a, b], 4)


def test_an_answer_without_tokens_has_no_hidden_states(tiny_llm):
    """An answer whose first token completes a stop string has no tokens, so early_records gives it no ``answer_hidden``
    (build_early stores hidden states only for answers with tokens)."""
    from detectors.dior.early import batch_question_features, early_records
    from detectors.llm.layers import hidden_state_indices

    questions = ["The capital of Egypt is", "The capital of Spain is"]
    first = [f.first_token_id for f in batch_question_features(tiny_llm, questions, PARAMS)]
    stop = [tiny_llm.tokenizer.decode([first[0]])]
    assert stop[0] and stop[0] not in tiny_llm.tokenizer.decode([first[1]])
    indices = hidden_state_indices([1, -1], tiny_llm.fingerprint.num_layers, "layers")
    empty, answered = early_records(tiny_llm, questions, [["Cairo"], ["Madrid"]], PARAMS, 4, stop, indices)
    assert empty["answer_ids"] == [] and empty["answer_prob"] == [] and "answer_hidden" not in empty
    assert answered["answer_ids"] and answered["answer_hidden"].shape == (len(answered["answer_ids"]), 2 * 64)
    assert answered["answer_hidden"].dtype == np.float16
    assert all(
        "answer_hidden" not in r for r in early_records(tiny_llm, questions, [["Cairo"], ["Madrid"]], PARAMS, 4, stop)
    )


def test_decoding_moves_each_steps_tokens_to_the_host_in_one_transfer(tiny_llm, monkeypatch):
    """The shared decoder reads no tensor element by element (a device sync per row and step): one ``tolist`` per
    choice of the live rows' tokens, the first from the prompts' logits, then one after each pass."""
    import sys

    from detectors.dior import early
    from detectors.dior.early import greedy_answer
    from detectors.llm import decoder

    feats = [f for f in early.batch_question_features(tiny_llm, BATCH, PARAMS) if not isinstance(f, RecordError)]
    reads: list[str] = []
    for name in ("__float__", "__int__", "__index__", "__bool__", "item", "tolist", "cpu", "numpy"):

        def spy(self, *args, _real=getattr(torch.Tensor, name), _name=name, **kwargs):
            if sys._getframe(1).f_code.co_filename == decoder.__file__:
                reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    passes = []
    hook = tiny_llm.model.register_forward_hook(lambda *_: passes.append(1))
    try:
        answers = early.decode_answers(tiny_llm, feats, 6, ["\n"])
    finally:
        hook.remove()
        monkeypatch.undo()
    assert passes and reads == ["tolist"] * (len(passes) + 1)
    assert [a.text for a in answers] == [
        greedy_answer(tiny_llm, question_features(tiny_llm, q, PARAMS), 6, ["\n"]) for q in BATCH if q.strip()
    ]
