"""CtrlA's layer ranges (the paper's scaled range and a window chosen on validation), the monitor's trigger
rates at τ, one score column per range, and the sign of the confidence score end to end on the tiny Llama."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import STATEMENTS as SHARED_STATEMENTS

from detectors.baselines.ctrla_confidence import question_scorers, realtime_scorers
from detectors.config.schema import ContrastParams, PromptParams, StatementParams
from detectors.ctrla.directions import Directions, contrast_differences, fit_pca
from detectors.ctrla.layer_ranges import choose_window
from detectors.ctrla.monitor import new_content
from detectors.ctrla.quality import MonitoredSet, early_set, realtime_set
from detectors.ctrla.steering import steer
from detectors.errors import InputError
from detectors.evaluation.metrics import auroc
from detectors.interfaces import Level
from detectors.llm.layers import decoder_layers
from pipelines.register_ctrla import chosen_range

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

STATEMENTS = SHARED_STATEMENTS[:8]  # the tiny Llama's facts


# ---- choosing a window on validation ----------------------------------------------------------------


def test_a_window_replaces_the_papers_range_only_when_surely_better_on_validation():
    gen = np.random.default_rng(0)
    labels = np.r_[np.ones(150), np.zeros(150)]
    signal = np.array([0.0, 0.0, 0.2, 1.0, 1.0, 0.0])  # the label shows in layers 4 and 5 (and weakly in 3)
    per_layer = labels[:, None] * signal + gen.normal(size=(300, 6))
    scores = lambda w: per_layer[:, [l - 1 for l in w]].mean(1)  # noqa: E731, E741
    choice = choose_window(scores, labels, [1, 2], 6, 2)  # a paper range without the signal: the rule leaves it
    assert choice.layers == [4, 5] and choice.val_auroc == pytest.approx(auroc(labels, scores([4, 5])))
    assert choice.choice["default"] == "1-2" and choice.choice["better"][0] == "4-5" and choice.choice["units"] == 300
    assert choice.choice["level"] == pytest.approx(1 - 0.05 / 5)  # five windows compete
    assert set(choice.by_first_layer) == {1, 2, 3, 4, 5} and choice.val_auroc == max(choice.by_first_layer.values())
    kept = choose_window(scores, labels, [3, 4, 5], 6, 2)  # the paper's range holds the signal: no window beats it
    assert kept.layers == [3, 4, 5] and kept.choice["chosen"] == "3-5" and "4-5" in kept.choice["ties"]
    few = np.r_[0:15, 150:165]  # 30 examples: the window with the signal is higher, but not surely
    tie = choose_window(lambda w: scores(w)[few], labels[few], [1, 2], 6, 2)
    assert tie.layers == [1, 2] and tie.choice["deltas"]["4-5"][0] > 0 and "4-5" in tie.choice["ties"]
    assert choose_window(scores, labels, [1, 2], 6, 6).layers == [1, 2, 3, 4, 5, 6]  # one window only, surely better
    undefined = choose_window(scores, np.ones(300), [1, 2, 3], 6, 3)  # one class only: nothing to choose on
    assert undefined.val_auroc is None and undefined.layers == [1, 2, 3] and undefined.choice is None
    with pytest.raises(InputError, match="evaluate_directions.layer_window = 7, but the LLM has 6 layers"):
        choose_window(scores, labels, [1, 2], 6, 7, "evaluate_directions.layer_window")


# ---- Eq. 2 per range, the hallucination score and the trigger rates at τ ----------------------------


def _hand_made() -> MonitoredSet:
    """Two layers whose projections are mirror images; the sink (position 0) stays out of the statistics.

    Layer 1 at the two generated positions 5, 6: the values so far are [1, -1, 1, -1, 5] (mean 1, std
    sqrt(4.8)), so Eq. 2 = 4 / sqrt(4.8) = 1.826; then [1, -1, 1, -1, 5, -5] (mean 0, std 3): -5/3.
    Layer 2 is the negation: -1.826 and +1.667. Their mean is 0 everywhere: no spread, Eq. 2 = 0 - τ.
    """
    layer1 = np.array([9.0, 1, -1, 1, -1, 5, -5])
    first = np.stack([layer1, -layer1], axis=1).astype(np.float32)
    second = first[:5].copy()  # nothing generated: the score falls back to -Eq. 2 at the last prompt token
    return MonitoredSet([first, second], starts=[5, 5], masks=[[True, False], []])


def test_eq2_per_range_gives_the_hand_computed_scores_and_trigger_rates():
    monitored = _hand_made()
    z = 4 / np.sqrt(4.8)
    np.testing.assert_allclose(monitored.eq2([1], 0.0, 3.0)[0][5:], [z, -5 / 3], atol=1e-5)
    # the answer's score is -min over its new non-stopword tokens (position 5 only)
    # [.., -Eq. 2 of [1,-1,1,-1]]
    np.testing.assert_allclose(monitored.answer_scores([1], 0.0, 3.0), [-z, 1.0], atol=1e-5)
    np.testing.assert_allclose(monitored.answer_scores([2], 0.0, 3.0), [z, -1.0], atol=1e-5)
    np.testing.assert_allclose(monitored.answer_scores([1, 2], 0.5, 3.0), [0.5, 0.5], atol=1e-6)  # no spread: -(0 - τ)
    np.testing.assert_allclose(monitored.token_scores([2], 0.0, 3.0)[0], [z, -5 / 3], atol=1e-5)
    assert monitored.token_scores([2], 0.0, 3.0)[1] == []
    rows = np.array([True, True])
    # layer 1: position 6 fires (a stopword-like token), the new content token does not, so CtrlA's trigger does not
    assert monitored.trigger_rates([1], 0.0, 3.0, rows) == {"token": 0.5, "new_content_token": 0.0, "sequence": 0.0}
    assert monitored.trigger_rates([2], 0.0, 3.0, rows) == {"token": 0.5, "new_content_token": 1.0, "sequence": 0.5}
    assert monitored.trigger_rates([1, 2], 0.5, 3.0, rows)["token"] == 1.0  # τ > 0: Eq. 2 = -τ < 0 fires everywhere
    assert monitored.trigger_rates([1, 2], 0.0, 3.0, rows)["token"] == 0.0  # Eq. 2 = 0 is not below zero
    assert monitored.trigger_rates([2], 0.0, 3.0, np.array([False, True])) == {
        "token": None,
        "new_content_token": None,
        "sequence": 0.0,
    }


# ---- the sign: which end is confident, and which score is high for hallucinations -------------------


def _unit(seed: int, dim: int = 64) -> torch.Tensor:
    v = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


@contextlib.contextmanager
def plant_at_tokens(model, shifts: dict[int, torch.Tensor]):
    """Add ``shifts[t]`` to the residual stream after layer 1 wherever the input token is ``t``."""
    current: dict[str, torch.Tensor] = {}

    def remember(module, args, kwargs):
        current["ids"] = args[0] if args else kwargs["input_ids"]

    def add(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h = h.clone()
        for token, shift in shifts.items():
            h[current["ids"] == token] += shift.to(h.device, h.dtype)
        return (h, *output[1:]) if isinstance(output, tuple) else h

    handles = [
        model.register_forward_pre_hook(remember, with_kwargs=True),
        decoder_layers(model)[0].register_forward_hook(add),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def test_the_confident_end_and_the_hallucination_score_have_the_papers_sign(tiny_llm):
    """CtrlA §3.2.3: positive ("confident") instructions project higher; Eq. 2 < 0 is unconfident; so an answer
    whose new token leans to the unconfident side must get the higher hallucination score and fire the trigger.

    Planted: the confident instruction's pass is shifted by +8u at layer 1 (so u is the confident end); at
    evaluation the token " Cairo" is shifted by -8u (unconfident), " river" by +8u (confident).
    """
    u = _unit(11)
    params = ContrastParams("Answer the question briefly.", "Complete the sentence: ?", StatementParams(limit=None))
    plant = lambda: steer(tiny_llm.model, {1: 8.0 * u})  # noqa: E731  the positive (confident) pass only
    stats = contrast_differences(tiny_llm, params, STATEMENTS, batch_size=4, positive_context=plant)
    vectors, explained = fit_pca(stats.diffs, seed=0)
    assert float(vectors[0] @ u) > 0.9  # the confident end is +u
    directions = Directions(
        "confidence", vectors, explained, stats.norms, [1], tiny_llm.fingerprint, {"llm": {"dtype": "float32"}}
    )

    tok = tiny_llm.tokenizer
    unsure, sure = (tok(w, add_special_tokens=False)["input_ids"] for w in (" Cairo", " river"))
    assert len(unsure) == len(sure) == 1
    questions = [
        "The capital of France is",
        "The capital of Italy is",
        "The country of Toronto is",
        "The capital of Japan is",
    ] * 2
    early = pd.DataFrame({"question": questions, "answer": ["Cairo", "river"] * 4, "label": [1, 0] * 4})
    with plant_at_tokens(tiny_llm.model, {unsure[0]: -8.0 * u, sure[0]: 8.0 * u}):
        monitored = early_set(tiny_llm, directions, early, PromptParams(template="{question}", chat=False), 3)
    scores = monitored.answer_scores([1], 0.0, 3.0)
    assert auroc(early["label"].to_numpy(), scores) == 1.0
    assert (scores[early["label"] == 1] > 0).all() and (scores[early["label"] == 0] < 0).all()
    # fires on every unconfident answer
    assert monitored.trigger_rates([1], 0.0, 3.0, early["label"].to_numpy() == 1)["sequence"] == 1.0
    # and on no confident one
    assert monitored.trigger_rates([1], 0.0, 3.0, early["label"].to_numpy() == 0)["sequence"] == 0.0

    # per generated token (the real-time set): the unconfident token scores high, the confident one low
    prompt = tok("The capital of Peru is", add_special_tokens=False)["input_ids"]
    realtime = pd.DataFrame({"prompt_ids": [prompt], "gen_ids": [unsure + sure]})
    with plant_at_tokens(tiny_llm.model, {unsure[0]: -8.0 * u, sure[0]: 8.0 * u}):
        per_token = realtime_set(tiny_llm, directions, realtime, 1).token_scores([1], 0.0, 3.0)[0]
    assert per_token[0] > 1 and per_token[1] < 0


def two_layer_directions(tiny_llm) -> Directions:
    """Confidence directions of the tiny Llama's two layers (random unit vectors), the paper's range both layers."""
    return Directions(
        "confidence",
        torch.stack([_unit(1), _unit(2)]),
        torch.tensor([0.5, 0.4]),
        torch.tensor([3.0, 5.0]),
        [1, 2],
        tiny_llm.fingerprint,
        {"llm": {"dtype": "float32"}},
    )


def test_the_early_sets_new_content_is_the_loops_the_few_shot_examples_are_not_the_question(tiny_llm):
    """CtrlA's trigger reads new content: words not in the question q nor earlier in the answer (the loop's
    :func:`~detectors.ctrla.monitor.new_content`). The early set's prompt holds few-shot examples; an answer word that
    only they hold ("Paris") is new, as it is in the loop, while a word of the question ("France") is not."""
    tok = tiny_llm.tokenizer
    directions = two_layer_directions(tiny_llm)
    prompt = PromptParams(template="The capital of France is Paris.\n{question}", chat=False)
    early = pd.DataFrame(
        {"question": ["The capital of Gaul is", "The language of France is"], "answer": ["Paris", "France"]}
    )
    monitored = early_set(tiny_llm, directions, early, prompt, 2)
    for q, a, mask in zip(early["question"], early["answer"], monitored.masks):
        answer_ids = tok(" " + a, add_special_tokens=False)["input_ids"]
        assert mask == new_content(tok, q, "", answer_ids)  # the loop's rule, on the same tokens
    assert all(monitored.masks[0]) and not any(monitored.masks[1])


# ---- score columns, scorers and the registered range --------------------------------------------------


def test_one_scorer_per_ctrla_column_and_stat():
    columns = {"id", "prob", "ctrla_confidence", "ctrla_confidence[val-layers]"}
    assert [s.name for s in question_scorers(columns)] == ["ctrla_confidence", "ctrla_confidence[val-layers]"]
    units = pd.DataFrame({"ctrla_confidence": [0.5, -1.0], "ctrla_confidence[val-layers]": [2.0, 3.0]})
    np.testing.assert_array_equal(question_scorers(columns)[1].score(units), [2.0, 3.0])
    scorers = realtime_scorers(Level.ENTITY, ["entropy", "ctrla_confidence[val-layers]"])
    assert [(s.name, s.stat, s.level) for s in scorers] == [
        ("ctrla_confidence[val-layers]", "ctrla_confidence[val-layers]", Level.ENTITY)
    ]


def test_the_registered_range_is_recorded_in_the_artifact_and_a_missing_one_is_a_clear_error(tmp_path, tiny_llm):
    paper = two_layer_directions(tiny_llm)
    chosen = Directions.load(paper.with_layers([2], "validation").save(tmp_path / "confidence"))
    assert chosen.layers == [2] and chosen.config["layer_selection"] == {"range": "validation", "paper_layers": [1, 2]}
    # extraction's layers stay known
    assert chosen.with_layers([1, 2], "paper").config["layer_selection"]["paper_layers"] == [
        1,
        2,
    ]
    assert json.loads((tmp_path / "confidence" / "detector.json").read_text())["layers"] == [2]

    metrics = {
        "honesty": {"ranges": {"paper": {"layers": [1], "val_auroc": 0.6, "test_auroc": 0.55}}},
        "confidence_early": {"ranges": {}},
    }
    assert chosen_range(metrics, "honesty", "paper")["val_auroc"] == 0.6
    assert chosen_range(metrics, "confidence", "paper") == {}  # no metrics: the artifact's own layers, no val AUROC
    with pytest.raises(InputError, match="register_ctrla.honesty_layers = 'validation'.*set it to 'paper'"):
        chosen_range(metrics, "honesty", "validation")
