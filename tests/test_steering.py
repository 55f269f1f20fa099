"""Honesty steering, the confidence monitor, the retrieval trigger, refusal detection and query masking
on the tiny Llama."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT

from detectors.ctrla.directions import Directions
from detectors.ctrla.monitor import (
    FIRING_RULE,
    ConfidenceMonitor,
    content_mask,
    detect_refusal,
    generate_segment,
    hallucination_score,
    masked_query,
    running_scores,
    score_sequences,
    token_words,
    trigger_position,
    unconfident,
)
from detectors.ctrla.registered import ConfidenceDetector
from detectors.ctrla.steering import steer, steering_vectors
from detectors.llm.layers import LayerTap, decoder_layers
from detectors.rag.families.ctrla import build as ctrla_trigger
from detectors.rag.triggers import TriggerContext

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def unit(seed: int, dim: int = 64) -> torch.Tensor:
    v = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return v / v.norm()


@pytest.fixture()
def directions(tiny_llm) -> Directions:
    return Directions(
        "confidence",
        torch.stack([unit(1), unit(2)]),
        torch.tensor([0.5, 0.4]),
        torch.tensor([3.0, 5.0]),
        [1, 2],
        tiny_llm.fingerprint,
        {"llm": {"dtype": "float32"}},
    )


def residuals(llm, ids) -> list[torch.Tensor]:
    """The residual stream after each decoder layer (what steering and the monitor act on)."""
    captured = {}
    with LayerTap(llm.model, [1, 2], lambda layer, h: captured.__setitem__(layer, h.detach().clone())), torch.no_grad():
        llm.model(ids.to(llm.device))
    return [captured[1], captured[2]]


def block_changes(llm, ids, vectors) -> list[torch.Tensor]:
    """Per layer: the steered model's output of the block minus the same block run on the same input without hooks."""
    records = []

    def record(module, args, kwargs, output):
        records.append((module, args, kwargs, output[0] if isinstance(output, tuple) else output))

    handles = [block.register_forward_hook(record, with_kwargs=True) for block in decoder_layers(llm.model)]
    try:
        with steer(llm.model, vectors), torch.no_grad():
            llm.model(ids.to(llm.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    changes = []
    with torch.no_grad():
        for module, args, kwargs, output in records:
            plain = module(*args, **kwargs)
            changes.append(output - (plain[0] if isinstance(plain, tuple) else plain))
    return changes


def test_steering_adds_exactly_lambda_v_at_the_chosen_layers_and_nowhere_else(tiny_llm, directions):
    ids = tiny_llm.tokenizer("The capital of France is Paris.", return_tensors="pt")["input_ids"]
    lam = 0.7
    # steering layer 2 only: layer 1 untouched, layer 2's residual moved by exactly lam * v at every token
    vectors = steering_vectors(directions, lam, [2], relative=False)
    plain = residuals(tiny_llm, ids)
    with steer(tiny_llm.model, vectors):
        steered = residuals(tiny_llm, ids)
    torch.testing.assert_close(steered[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(
        steered[1] - plain[1], (lam * directions.vectors[1]).to(plain[1].device).expand_as(plain[1]), rtol=0, atol=1e-5
    )
    # every block: its output differs from the unhooked block on the same input by lam * v_l where steered, 0 elsewhere
    changes = block_changes(tiny_llm, ids, steering_vectors(directions, lam, [1], relative=False))
    torch.testing.assert_close(
        changes[0], (lam * directions.vectors[0]).to(changes[0].device).expand_as(changes[0]), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(changes[1], torch.zeros_like(changes[1]), rtol=0, atol=1e-5)
    relative = steering_vectors(directions, lam, [1, 2], relative=True)
    torch.testing.assert_close(relative[2], lam * 5.0 * directions.vectors[1])


def test_steering_hooks_are_removed_on_exit_and_when_generation_raises(tiny_llm, directions):
    blocks = decoder_layers(tiny_llm.model)
    before = [len(b._forward_hooks) for b in blocks]
    ids = tiny_llm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    reference = residuals(tiny_llm, ids)
    with steer(tiny_llm.model, steering_vectors(directions, 1.0, [1, 2], relative=False)):
        assert [len(b._forward_hooks) for b in blocks] == [n + 1 for n in before]
    assert [len(b._forward_hooks) for b in blocks] == before
    with pytest.raises(ValueError):
        with steer(tiny_llm.model, steering_vectors(directions, 1.0, [1, 2], relative=False)):
            tiny_llm.model.generate(ids.to(tiny_llm.device), max_new_tokens=-1)  # generation raises inside the block
    assert [len(b._forward_hooks) for b in blocks] == before
    with pytest.raises(RuntimeError), ConfidenceMonitor(tiny_llm.model, directions):
        raise RuntimeError("the RAG loop failed")
    assert [len(b._forward_hooks) for b in blocks] == before
    for a, b in zip(reference, residuals(tiny_llm, ids)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_running_scores_standardise_over_the_sequence_so_far():
    x = torch.tensor([[100.0, 1.0, 3.0, 2.0, -10.0]])
    got = running_scores(x, tau=0.0, clip=1.5, skip=1)[0].numpy()
    expected = [0.0, 0.0]  # the sink is skipped; one token has no spread
    for k in range(2, 5):
        seen = x[0, 1 : k + 1].double().numpy()
        expected.append(float(np.clip((seen[-1] - seen.mean()) / seen.std(), -1.5, 1.5)))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert running_scores(x, tau=0.5)[0, 0] == pytest.approx(-0.5)
    padded = torch.cat([x, torch.zeros(1, 3)], dim=1)
    np.testing.assert_allclose(running_scores(padded)[0, :5].numpy(), running_scores(x)[0].numpy(), atol=1e-6)


def test_monitor_during_generation_matches_teacher_forcing(tiny_llm, directions):
    """One implementation: the served monitor (streamed, steered or not) and the evaluation scorer agree."""
    ids = tiny_llm.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    for steering in (None, steering_vectors(directions, 0.5, [1], relative=False)):
        monitor = ConfidenceMonitor(tiny_llm.model, directions)
        segment = generate_segment(
            tiny_llm, ids, 5, monitor=monitor, steering=steering, question="The capital of France is"
        )
        assert 1 <= len(segment.scores) == len(segment.token_ids) <= 5
        with steer(tiny_llm.model, steering or {}):
            forced = score_sequences(tiny_llm, directions, [ids[0].tolist() + segment.token_ids], 1)[0]
        np.testing.assert_allclose(segment.scores, forced[ids.shape[1] :], atol=1e-4)
    # batched teacher forcing with a shared prefix gives the same scores as one sequence at a time
    seqs = [
        tiny_llm.tokenizer(t)["input_ids"]
        for t in ("The capital of Spain is Madrid", "The capital of Peru is", "The river")
    ]
    together = score_sequences(tiny_llm, directions, seqs, batch_size=3)
    for seq, scores in zip(seqs, together):
        np.testing.assert_allclose(scores, score_sequences(tiny_llm, directions, [seq], 1)[0], atol=1e-4)


def test_a_segment_says_where_the_trigger_fires(tiny_llm, directions):
    """generate_segment computes CtrlA's trigger once: the first generated token of a new content word scoring < 0."""
    question = "The capital of France is"
    ids = tiny_llm.tokenizer(question, return_tensors="pt")["input_ids"]
    for tau in (0.0, 10.0, -10.0):  # scores are clipped to ±3: tau 10 makes every token unconfident, -10 none
        segment = generate_segment(
            tiny_llm, ids, 8, monitor=ConfidenceMonitor(tiny_llm.model, directions, tau=tau), question=question
        )
        fires = [i for i, (new, s) in enumerate(zip(segment.new_content, segment.scores)) if new and s < 0]
        assert segment.trigger_position == (fires[0] if fires else None) and segment.retrieve == bool(fires)
        if tau == 10.0:
            assert any(segment.new_content) and segment.trigger_position == segment.new_content.index(True)
        if tau == -10.0:
            assert segment.trigger_position is None and not segment.retrieve
    unmonitored = generate_segment(tiny_llm, ids, 4, question=question)
    assert unmonitored.trigger_position is None and not unmonitored.retrieve


def test_the_trigger_counts_only_new_non_stopword_tokens(tiny_llm):
    tok = tiny_llm.tokenizer
    gen = tok(" is the capital of Paris and Lima", add_special_tokens=False)["input_ids"]
    mask = content_mask(tok, "The capital of France is", gen)
    words = {tok.decode([t]).strip(): m for t, m in zip(gen, mask) if tok.decode([t]).strip()}
    assert (
        words.get("Lima", True)
        and not words.get("capital", True)
        and not words.get("the", True)
        and not words.get("and", True)
    )
    scores = np.array([-5.0 if m is False else 0.2 for m in mask])
    assert hallucination_score(scores, mask, fallback=0.0) == pytest.approx(-0.2)  # only new content words count
    assert hallucination_score(np.array([]), [], fallback=0.3) == 0.3


def test_refusal_patterns_from_params_detect_refusals():
    patterns = yaml.safe_load((ROOT / "params.yaml").read_text())["extract_directions"]["monitor"]["refusal_patterns"]
    for text in (
        "I don't know who that is.",
        "I\u2019m not sure about that.",
        "I cannot answer that question.",
        "The author is not specified in the documents.",
        "I have no comment.",
    ):
        assert detect_refusal(text, patterns), text
    for text in ("Paris is the capital of France.", "I know that Lima is in Peru."):
        assert detect_refusal(text, patterns) is None, text


def test_query_masking_drops_only_new_unconfident_words(tiny_llm):
    tok = tiny_llm.tokenizer
    gen = tok(" Paris is in Spain", add_special_tokens=False)["input_ids"]
    words = token_words(tok, gen)  # word 0 = Paris (old: in the question), word 3 = Spain (new)
    scores = np.array([-1.0 if w in (0, 3) else 0.5 for w in words])
    query = masked_query(tok, "Where is Paris?", "", gen, scores)
    assert query.startswith("Where is Paris?") and "Spain" not in query and "Paris is in" in query


def test_truthfulqa_questions_batched_score_as_each_alone_under_steering(tiny_llm):
    """MC1 with several questions (and their candidates) per pass picks what a plain full forward of prefix +
    question + candidate picks, with and without steering."""
    from detectors.ctrla.truthfulqa import mc_accuracy

    examples = [
        {
            "input": "What is the capital of Egypt?",
            "target_scores": {"Cairo.": 1, "Paris.": 0, "The capital of Egypt is Lima.": 0},
        },
        {"input": "Which river flows through Cairo?", "target_scores": {"The Seine.": 0, "The Nile.": 1}},
        {"input": "Who ran fast?", "target_scores": {"Bolt.": 1, "Nobody at all, ever.": 0, "A cat.": 0, "Kenya.": 0}},
        {"input": "What is the sport of Bolt?", "target_scores": {"Athletics.": 0, "Chess.": 1}},
    ]
    prefix = "Q: What is the capital of France?\nA: Paris."
    vectors = {
        1: 2.0
        * torch.nn.functional.normalize(
            torch.randn(tiny_llm.fingerprint.hidden_size, generator=torch.Generator().manual_seed(0)), dim=0
        )
    }

    def reference(steering) -> list[bool]:
        hits = []
        with steer(tiny_llm.model, steering), torch.no_grad():
            for ex in examples:
                context = (
                    tiny_llm.tokenizer(prefix)["input_ids"]
                    + tiny_llm.tokenizer(f"\nQ: {ex['input']}\nA:", add_special_tokens=False)["input_ids"]
                )
                scores = []
                for answer in ex["target_scores"]:
                    a = tiny_llm.tokenizer(f" {answer}", add_special_tokens=False)["input_ids"]
                    logp = torch.log_softmax(
                        tiny_llm.model(torch.tensor([context + a], device=tiny_llm.device)).logits[0].float(), -1
                    )
                    scores.append(float(sum(logp[len(context) - 1 + j, t] for j, t in enumerate(a))))
                hits.append(bool(list(ex["target_scores"].values())[int(np.argmax(scores))]))
        return hits

    for steering in ({}, vectors):
        expected = reference(steering)
        for batch_size in (1, 3):
            accuracy, hits = mc_accuracy(tiny_llm, prefix, examples, steering, progress=False, batch_size=batch_size)
            assert hits.tolist() == expected and accuracy == pytest.approx(np.mean(expected))


def test_ctrlas_firing_rule_is_strictly_below_zero():
    """CtrlA §3.2.3 (arXiv 2405.18727): m_k < 0 is unconfident, so a score of exactly 0 does not fire."""
    eq2 = np.array([-1e-9, 0.0, -0.0, 1e-9, -2.0])
    assert unconfident(eq2).tolist() == [True, False, False, False, True]
    assert trigger_position(eq2, [False, True, True, True, False]) is None  # only the new content counts
    assert trigger_position(eq2, [True, True, True, True, True]) == 0
    assert trigger_position([0.0, 0.5, -0.1], [True, True, True]) == 2
    assert trigger_position([], []) is None
    assert "< 0" in FIRING_RULE


def test_the_rag_loops_ctrla_trigger_fires_where_the_monitor_does(tiny_llm, directions):
    """The loop's CtrlA trigger (a threshold on -Eq. 2, fired at or above it) decides as the monitor's trigger: not at
    a score of exactly 0 (a threshold of 0.0 fired there), at the first new unconfident token otherwise."""
    monitor = yaml.safe_load((ROOT / "params.yaml").read_text())["extract_directions"]["monitor"]
    config = {"llm": {"dtype": "float32"}, "n_statements": 4, "monitor": monitor}
    detector = ConfidenceDetector(dataclasses.replace(directions, config=config)).attach(tiny_llm)
    trigger = ctrla_trigger(TriggerContext(tiny_llm, name="ctrla", detector=detector), None)
    for eq2, new in (
        ([0.0, 0.3, 0.0], [True, True, True]),  # exactly 0: confident, no retrieval
        ([0.0, -0.0, -1e-30, -0.4], [True, True, True, True]),
        ([-0.5, 0.0, -0.2], [False, True, True]),
        ([0.1, -3.0], [True, False]),
    ):
        eq2 = np.asarray(eq2, dtype=np.float64)
        stats = {"ctrla_eq2": eq2, "ctrla_confidence": -eq2, "new_content": np.asarray(new), "refusal": False}
        assert trigger.first(trigger.token_scores(stats)) == trigger_position(eq2, new), (eq2, new)
