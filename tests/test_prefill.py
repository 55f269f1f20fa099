"""Prompts that run once (detectors.llm.prefill) on the tiny Llama: a prompt continued from cached states gives the
logits and the continuation of a prompt run whole, the cache finds the longest prefix and keeps within its budget,
and decoding appends to a cache that grows in place."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from detectors.llm.generate import generate, row_generator
from detectors.llm.kv import GrowingCache, as_cache, cache_kv, prefix_cache
from detectors.llm.prefill import BLOCK, KVCache, prefill, shared_prefixes

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PRIMER = "The capital of France is Paris.\nThe language of Germany is German.\n"


def ids(llm, text: str) -> list[int]:
    return llm.tokenizer(text)["input_ids"]


def whole_logits(llm, rows: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [llm.model(torch.tensor([r], device=llm.device)).logits[0, -1].float() for r in rows]


def test_rows_continued_from_cached_prefixes_give_the_logits_of_the_whole_prompt(tiny_llm):
    rows = [
        ids(tiny_llm, PRIMER + q) for q in ("The capital of Italy is", "The currency of Japan is", "Water boils at")
    ]
    rows.append(rows[0][:-2])  # a row that is a prefix of another
    expected = whole_logits(tiny_llm, rows)
    cache = KVCache()
    first = prefill(tiny_llm, rows, cache, batch_size=2, keep_kv=True)
    assert len(cache) >= 1 and all(torch.allclose(a, b, atol=1e-4) for a, b in zip(first.logits, expected))
    passes = []
    again = prefill(tiny_llm, rows, cache, batch_size=4, on_batch=lambda idx, calls, s: passes.append(len(idx)))
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(again.logits, expected))
    assert cache.reused >= sum(len(r) - 1 for r in rows)  # every row ran only its last token the second time
    assert all(s[0][0].shape[2] == len(r) for s, r in zip(first.kv, rows))  # each row's states cover all its tokens


def test_a_prefix_several_rows_share_runs_once_and_only_when_it_saves_enough():
    base = list(range(100, 100 + BLOCK + 4))
    rows = [base + [1, 2, 3], base + [1, 2, 4], base + [9] * 20 + [5], base + [9] * 20 + [6]]
    prefixes = shared_prefixes(rows)
    # base + [1, 2] adds only two tokens to base: not worth a pass
    assert prefixes == [
        tuple(base),
        tuple(base + [9] * 20),
    ]


def test_the_cache_finds_the_longest_prefix_and_keeps_within_its_budget(tiny_llm):
    long = ids(tiny_llm, PRIMER + "The capital of Italy is Rome. The capital of Spain is")
    kv = prefix_cache(tiny_llm, long)
    size = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
    cache = KVCache(max_bytes=int(size * 1.5))
    cache.store(long[: BLOCK * 2], [(k[:, :, : BLOCK * 2], v[:, :, : BLOCK * 2]) for k, v in kv])
    cache.store(long, kv)  # extends the first entry: it replaces it
    assert len(cache) == 1
    n, found = cache.lookup(long + [5, 6])
    assert n == len(long) and torch.equal(found[0][0], kv[0][0])
    assert cache.lookup(long)[0] == len(long) - 1  # a sequence's own last token always runs (its logits are needed)
    assert cache.lookup([7] * 40) == (0, None)
    other = ids(tiny_llm, "Water boils at a hundred degrees.")
    assert BLOCK <= len(other) < len(long), (len(other), len(long))
    cache.store(other, prefix_cache(tiny_llm, other))  # over the budget: the least recently used entry goes
    assert cache.bytes <= cache.max_bytes and cache.lookup(long + [5])[0] == 0


def test_generation_from_cached_states_is_the_models_greedy_continuation(tiny_llm):
    prompts = [PRIMER + "The capital of Italy is", PRIMER + "The language of Spain is", "Water boils at"]
    enc = [ids(tiny_llm, p) for p in prompts]
    expected = []
    for row in enc:
        with torch.no_grad():
            out = tiny_llm.model.generate(
                torch.tensor([row], device=tiny_llm.device),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=tiny_llm.tokenizer.pad_token_id,
            )
        said = out[0, len(row) :].tolist()
        cut = next((i for i, t in enumerate(said) if t in tiny_llm.eos_token_ids), len(said))
        expected.append(said[:cut])
    cache = KVCache()
    for _ in range(2):  # the second time every prompt continues its cached states
        got = generate(tiny_llm, prompts, 6, stop=(), batch_size=2, cache=cache)
        assert [g.ids for g in got] == expected


def test_sampled_rows_draw_from_their_own_streams_whatever_the_batch(tiny_llm):
    prompts = [PRIMER + "The capital of Italy is", "Water boils at", PRIMER + "The language of Spain is"]
    streams = lambda: [row_generator(0, p) for p in prompts]  # noqa: E731
    together = generate(tiny_llm, prompts, 5, stop=(), batch_size=3, generators=streams())
    alone = [generate(tiny_llm, [p], 5, stop=(), batch_size=1, generators=[g])[0] for p, g in zip(prompts, streams())]
    assert [g.ids for g in together] == [g.ids for g in alone]


def test_a_growing_cache_appends_in_place_and_answers_as_a_dynamic_one(tiny_llm):
    prompt = ids(tiny_llm, PRIMER + "The capital of Italy is")
    kv = prefix_cache(tiny_llm, prompt)
    outs = {}
    for name, cache in (
        (
            "dynamic",
            DynamicCache(
                ddp_cache_data=[(k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)) for k, v in kv],
                config=tiny_llm.model.config,
            ),
        ),
        ("growing", as_cache(kv, 2, tiny_llm.model.config)),
    ):
        logits = []
        for step in range(4):
            with torch.no_grad():
                out = tiny_llm.model(
                    torch.tensor([[5 + step], [9 + step]], device=tiny_llm.device),
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=torch.tensor([[len(prompt) + step]] * 2, device=tiny_llm.device),
                )
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
            if step == 1:
                cache.batch_select_indices(torch.tensor([0, 1], device=tiny_llm.device))
        outs[name] = (torch.stack(logits), cache)
    assert isinstance(outs["growing"][1], GrowingCache)
    assert torch.allclose(outs["dynamic"][0], outs["growing"][0], atol=1e-5)
    assert [k.shape for k, _ in cache_kv(outs["growing"][1])] == [k.shape for k, _ in cache_kv(outs["dynamic"][1])]
