"""IG attribution: ours against an independent step-by-step implementation, and Eq. 1 / Eq. 3."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detectors.config.schema import EarlyFeatureParams, PromptParams
from detectors.dior.attribution import (
    attribution_distribution,
    attribution_entropy,
    keyword_candidates,
    token_attributions,
)
from detectors.dior.early import question_features
from detectors.llm.offsets import token_offsets

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)


def naive_ig(model, ids, mask, target, n_steps):
    """Gauss-Legendre IG one step at a time, full forward pass, no captum: the definition itself."""
    x, w = np.polynomial.legendre.leggauss(n_steps)
    alphas, weights = 0.5 * (1 + x), 0.5 * w
    embeds = model.get_input_embeddings()(ids).detach()
    baseline = embeds * (~mask)[None, :, None]
    total = torch.zeros_like(embeds)
    for a, wt in zip(alphas, weights):
        point = (baseline + float(a) * (embeds - baseline)).requires_grad_(True)
        prob = torch.softmax(model(inputs_embeds=point).logits[0, -1], -1)[target]
        (grad,) = torch.autograd.grad(prob, point)
        total += float(wt) * grad
    return ((embeds - baseline) * total)[0].norm(dim=-1)[mask].cpu().numpy()


@pytest.mark.parametrize(
    "prompt",
    [
        PromptParams(template="{question}", chat=False),  # no prefix before the question
        PromptParams(template="Q: {question} A:", chat=False),
        PromptParams(template="Complete: {question}", chat=True, system="Be brief."),  # long cached prefix
    ],
)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_ig_matches_step_by_step_definition(tiny_llm, prompt, batch_size):
    ids, mask = tiny_llm.encode_prompt("The capital of Kenya is", prompt)
    target = int(tiny_llm.model(ids).logits[0, -1].argmax())
    ours = token_attributions(tiny_llm.model, ids, mask, target, n_steps=8, batch_size=batch_size)
    ref = naive_ig(tiny_llm.model, ids, mask, target, 8)
    assert ours.shape == (int(mask.sum()),)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-7)


def test_entropy_is_log_n_for_uniform_and_zero_for_peaked():
    assert attribution_entropy(attribution_distribution(np.ones(7))) == pytest.approx(np.log(7))
    assert attribution_entropy(attribution_distribution(np.array([5.0, 0, 0, 0]))) == 0.0
    spread = attribution_entropy(attribution_distribution(np.array([3.0, 1, 1, 1])))
    assert 0 < spread < np.log(4)


def test_distribution_of_all_zero_attributions_is_uniform():
    np.testing.assert_allclose(attribution_distribution(np.zeros(4)), np.full(4, 0.25))


def decoded(tokens: list[str]) -> tuple[str, list[int]]:
    """The text of decoded tokens and their character offsets (what token_offsets gives for whole characters)."""
    return "".join(tokens), [sum(len(t) for t in tokens[:i]) for i in range(len(tokens) + 1)]


def test_keyword_candidates_are_words_above_the_mean():
    tokens = ["The", " cap", "ital", " of", " Occ", "itan", "ia", " is"]
    p = attribution_distribution(np.array([0.05, 0.3, 0.02, 0.01, 0.02, 0.4, 0.1, 0.1]))
    # mean is 1/8: "capital" (via "cap") and "Occitania" (via "itan") are above it, "is" is not
    assert keyword_candidates(*decoded(tokens), p) == ["capital", "Occitania"]
    assert keyword_candidates(*decoded(["A", " b", "."]), np.array([0.2, 0.2, 0.6])) == []  # punctuation is no word
    # a hot apostrophe token is inside its word, a hot hyphen between two words is neither; a word comes once
    tokens = [" Kenya", "'", "s", " Saint", "-", "Etienne", " kenya", "'s", " Rome", "?"]
    p = np.array([0, 1, 0, 0, 1, 0, 1, 0, 0, 0.0])
    assert keyword_candidates(*decoded(tokens), p) == ["Kenya's"]


@pytest.mark.parametrize(
    ("question", "words"),
    [("Ünïcødé", ["Ünïcødé"]), ("Zürich", ["Zürich"]), ("São Paulo", ["São", "Paulo"])],
)
def test_keywords_are_whole_words_when_a_character_spans_tokens(tiny_llm, question, words):
    """The tiny tokenizer splits ü, ã, Ü ... into one token per UTF-8 byte: any hot token of a word, the byte that
    completes a character included, makes the whole word a keyword, never a replacement character or a fragment."""
    ids = tiny_llm.tokenizer(question, add_special_tokens=False)["input_ids"]
    text, offsets = tiny_llm.tokenizer.decode(ids), token_offsets(tiny_llm, ids)
    by_byte = [i for i, t in enumerate(ids) if tiny_llm.tokenizer.decode([t]) == "\ufffd"]
    assert by_byte  # the case at hand: characters spread over tokens
    for hot in range(len(ids)):
        p = np.full(len(ids), 0.1)
        p[hot] = 1.0
        got = keyword_candidates(text, offsets, p)
        assert len(got) == 1 and got[0] in words
    f = question_features(
        tiny_llm,
        question,
        EarlyFeatureParams(prompt=PromptParams(template="{question}", chat=False), n_steps=4, hidden_layers=[-1]),
    )
    assert f.keywords and set(f.keywords) <= set(words)  # the early path: its tokens decoded together


@pytest.mark.parametrize("rows", [1, 5, 24])  # a question's steps over several passes / questions sharing a pass
def test_ig_of_several_questions_at_once_equals_one_at_a_time(tiny_llm, rows):
    from detectors.dior.attribution import IGItem, batch_token_attributions
    from detectors.llm.kv import prefix_kv

    prompt = PromptParams(template="Q: {question} A:", chat=False)  # a cached prefix and a suffix after the question
    encoded = [
        tiny_llm.encode_prompt(q, prompt)
        for q in ("The capital of Kenya is", "Paris is in", "The longest river of the whole of Africa is the")
    ]
    common = min(int(mask.nonzero()[0, 0]) for _, mask in encoded)  # "Q:" is the same before every question
    items, alone = [], []
    for ids, mask in encoded:
        target = int(tiny_llm.model(ids).logits[0, -1].argmax())
        items.append(IGItem(ids[0, common:], mask[common:], target))  # a token between prefix and question stays fixed
        alone.append(naive_ig(tiny_llm.model, ids, mask, target, 6))
    prefix = prefix_kv(tiny_llm.model, ids, common)
    batched = batch_token_attributions(tiny_llm.model, items, 6, batch_size=rows, prefix=prefix)
    for ours, ref in zip(batched, alone):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-7)
    one_by_one = [batch_token_attributions(tiny_llm.model, [it], 6, batch_size=6, prefix=prefix)[0] for it in items]
    for ours, single in zip(batched, one_by_one):
        np.testing.assert_allclose(attribution_distribution(ours), attribution_distribution(single), atol=1e-6)
