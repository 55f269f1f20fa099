"""The baselines that need the LLM, on the tiny Llama: DRAGIN's RIND against a hand computation from the
model's own attention weights and logits, RetroRAG's evaluator against a hand softmax, and the
score_baselines stage on a small hand-made early and real-time set."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import ROOT, known_facts

from detectors.baselines.retrorag import self_consistency_scores, self_evaluation_scores
from detectors.baselines.rind import rind_scores
from detectors.config import load_section
from detectors.config.core import from_dict
from detectors.config.schema import PromptParams
from detectors.dior.recorder import generate_traced
from detectors.llm.judge import word_token_ids
from detectors.llm.layers import attention_implementation
from detectors.llm.loading import prepare_llm
from pipelines import score_baselines

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PROMPT = "The capital of France is"
# " and", " the", " of" are stop words, "." punctuation
WORDS = [
    " Paris",
    " and",
    " the",
    " river",
    " of",
    " Spain",
    ".",
]
CONTENT = [1, 0, 0, 1, 0, 1, 0]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def continuation(tok) -> tuple[list[int], list[int]]:
    """Token ids of the words, and each token's expected s_i (a word's tokens share it)."""
    out, content = [], []
    for word, flag in zip(WORDS, CONTENT):
        out += ids(tok, word)
        content += [flag] * len(ids(tok, word))
    assert out == ids(tok, "".join(WORDS))  # the words tokenise the same alone as together
    return out, content


def by_hand(model, prompt: list[int], cont: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Entropy (Eq. 1) and a_max (last layer, per head max over the token's own and later query rows, mean over heads)
    with loops."""
    with torch.no_grad(), attention_implementation(model, "eager"):
        out = model(torch.tensor([prompt + cont], device=model.device), output_attentions=True)
    att, logits, p = out.attentions[-1][0].double(), out.logits[0].double(), len(prompt)
    entropy, a_max = [], []
    for k in range(len(cont)):
        probs = torch.softmax(logits[p + k - 1], -1)
        entropy.append(float(-(probs * probs.log()).sum()))
        i, heads = p + k, att.shape[0]
        a_max.append(sum(max(float(att[h, j, i]) for j in range(i, p + len(cont))) for h in range(heads)) / heads)
    return np.array(entropy), np.array(a_max)


def sentence_scores(entropy, a_max, words: list[list[int]], content: list[int]) -> np.ndarray:
    """DRAGIN's released code on one sentence's words (token indices each): a word's attention is its tokens' sum, its
    entropy their mean; attentions normalised to sum to the number of words; score = that × entropy × s, per token."""
    attention = np.array([a_max[w].sum() for w in words])
    normalised = attention / attention.sum() * len(words)
    out = np.zeros(len(entropy))
    for k, w in enumerate(words):
        out[w] = normalised[k] * entropy[w].mean() * content[k]
    return out


def test_rind_combines_entropy_and_attention_over_a_sentences_words_as_dragins_code_does(tiny_llm):
    tok = tiny_llm.tokenizer
    prompt, (cont, content) = ids(tok, PROMPT), continuation(tok)
    entropy, a_max = by_hand(tiny_llm.model, prompt, cont)
    (trace,) = rind_scores(tiny_llm, [prompt], [cont], [entropy])
    np.testing.assert_allclose(trace.attention, a_max, rtol=1e-4, atol=1e-7)
    assert trace.attention[-1] > 0  # the last token's attention to itself: a one-token answer has a value
    # whitespace-delimited words: the final "." belongs to " Spain" (a content word); stop words score 0
    spans, start = [], 0
    for word in WORDS[:-2] + [" Spain."]:
        n = len(ids(tok, word))
        spans.append(list(range(start, start + n)))
        start += n
    assert trace.content.tolist() == content[: -len(ids(tok, "."))] + [1] * len(ids(tok, "."))
    np.testing.assert_allclose(
        trace.rind, sentence_scores(entropy, a_max, spans, [1, 0, 0, 1, 0, 1]), rtol=1e-4, atol=1e-7
    )
    assert (trace.rind[trace.content == 0] == 0).all() and (trace.rind[trace.content == 1] > 0).all()
    assert tiny_llm.model.config._attn_implementation == "sdpa"  # restored after the eager pass


def test_rind_normalises_attention_within_each_sentence_and_scores_a_one_word_answer_by_its_entropy(tiny_llm):
    tok = tiny_llm.tokenizer
    prompt = ids(tok, PROMPT)
    cont = ids(tok, " Paris is old. Rivers flow")
    entropy, a_max = by_hand(tiny_llm.model, prompt, cont)
    (trace,) = rind_scores(tiny_llm, [prompt], [cont], [entropy])
    words = [ids(tok, w) for w in (" Paris", " is", " old.", " Rivers", " flow")]
    assert sum(map(len, words)) == len(cont)
    bounds = np.cumsum([0] + [len(w) for w in words])
    spans = [list(range(bounds[k], bounds[k + 1])) for k in range(len(words))]
    expected = sentence_scores(entropy, a_max, spans[:3], [1, 0, 1]) + sentence_scores(
        entropy, a_max, spans[3:], [1, 1]
    )
    np.testing.assert_allclose(trace.rind, expected, rtol=1e-4, atol=1e-7)
    # a one-word answer (DRAGIN's Eq. 3 gives its last token nothing to read): its score is its entropy
    peru, lima = ids(tok, "The capital of Peru is"), ids(tok, " Lima")[:1]
    (one,) = rind_scores(tiny_llm, [peru], [lima], [by_hand(tiny_llm.model, peru, lima)[0]])
    assert one.rind[0] == pytest.approx(one.entropy[0], rel=1e-6) and one.rind[0] > 0


def test_rind_batched_with_padding_equals_one_by_one(tiny_llm):
    tok = tiny_llm.tokenizer
    cont, _ = continuation(tok)
    prompts = [
        ids(tok, PROMPT),
        ids(tok, "The river of"),
        ids(tok, "The capital of Spain is Madrid and"),
        ids(tok, "A"),
    ]
    conts = [cont, cont[:3], cont[2:], []]  # the last generated nothing
    entropies = [by_hand(tiny_llm.model, p, c)[0] for p, c in zip(prompts, conts)]
    batched = rind_scores(tiny_llm, prompts, conts, entropies, batch_size=3)
    for p, c, e, got in zip(prompts, conts, entropies, batched):
        (alone,) = rind_scores(tiny_llm, [p], [c], [e])
        np.testing.assert_allclose(got.rind, alone.rind, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got.attention, alone.attention, rtol=1e-4, atol=1e-7)
    assert len(batched[-1].rind) == 0


def test_rind_while_generating_is_a_running_max_over_the_tokens_seen_so_far(tiny_llm):
    """Called after each step on the text so far, a token's attention maximum only grows; at the end its score is the
    full one."""
    tok = tiny_llm.tokenizer
    prompt, (cont, _) = ids(tok, PROMPT), continuation(tok)
    entropy = by_hand(tiny_llm.model, prompt, cont)[0]
    (full,) = rind_scores(tiny_llm, [prompt], [cont], [entropy])
    previous = None
    for m in range(1, len(cont) + 1):
        (now,) = rind_scores(tiny_llm, [prompt], [cont[:m]], [entropy[:m]])
        if previous is not None:
            assert (now.attention[: m - 1] >= previous.attention - 1e-7).all()
        previous = now
    np.testing.assert_allclose(previous.rind, full.rind, rtol=1e-5)


def test_attention_implementation_is_restored_when_the_pass_raises(tiny_llm):
    with pytest.raises(RuntimeError, match="boom"), attention_implementation(tiny_llm.model, "eager"):
        assert tiny_llm.model.config._attn_implementation == "eager"
        raise RuntimeError("boom")
    assert tiny_llm.model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="non-empty prompt"):
        rind_scores(tiny_llm, [[]], [[5]], [[0.1]])
    with pytest.raises(ValueError, match="continuation 0 has 2 tokens but 1 recorded entropies"):
        rind_scores(tiny_llm, [[4]], [[5, 6]], [[0.1]])


TEMPLATE = "{question} {answer}?"


def test_retrorag_score_is_the_two_way_softmax_of_yes_and_no(tiny_llm):
    tok = tiny_llm.tokenizer
    yes, no = word_token_ids(tok, ["Y"]), word_token_ids(tok, ["N"])
    assert sorted(yes) == sorted({ids(tok, "Y")[0], ids(tok, "y")[0]})  # " Y" is two tokens here: left out
    pairs = [
        ("The capital of France is", "Paris"),
        ("The capital of Spain is", "Lima"),
        ("The river of Paris is", "the Seine"),
    ]
    got = self_evaluation_scores(tiny_llm, pairs, TEMPLATE, yes=("Y",), no=("N",), batch_size=2)
    for (q, a), score in zip(pairs, got):
        with torch.no_grad():
            logits = (
                tiny_llm.model(torch.tensor([ids(tok, TEMPLATE.format(question=q, answer=a))], device=tiny_llm.device))
                .logits[0, -1]
                .double()
            )
        probs = torch.softmax(logits, -1)
        p_yes, p_no = float(probs[yes].sum()), float(probs[no].sum())
        assert score == pytest.approx(p_yes / (p_yes + p_no), rel=1e-4)
    with pytest.raises(ValueError, match=r"none of the words \['yes'\]"):
        self_evaluation_scores(tiny_llm, pairs, TEMPLATE, yes=("yes",), no=("N",))


def test_retrorag_score_is_higher_for_a_right_answer_than_a_wrong_one(tiny_llm):
    """The tiny Llama never saw a yes/no question, so a copy learns for a few seconds to judge its memorised
    facts ("Y" after the right answer, "N" after another fact's); read in batches with padding and a shared
    prefix, the score must then rank the right answer above the wrong one for most questions and on average
    (a few questions stay misjudged after this short training). Reading the wrong position or swapping yes
    and no fails this."""
    tok, facts = tiny_llm.tokenizer, known_facts()
    right = [(f["question"], f["answers"][0]) for f in facts]
    wrong = [(f["question"], facts[(k + 1) % len(facts)]["answers"][0]) for k, f in enumerate(facts)]
    judge = copy.deepcopy(tiny_llm)
    texts = [TEMPLATE.format(question=q, answer=a) + "Y" for q, a in right] + [
        TEMPLATE.format(question=q, answer=a) + "N" for q, a in wrong
    ]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(judge.device)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(judge.model.parameters(), lr=3e-3)
    judge.model.train()
    for _ in range(120):
        loss = judge.model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    judge.model.eval()
    got_right = self_evaluation_scores(judge, right, TEMPLATE, yes=("Y",), no=("N",), batch_size=5)
    got_wrong = self_evaluation_scores(judge, wrong, TEMPLATE, yes=("Y",), no=("N",), batch_size=5)
    assert (got_right > got_wrong).mean() >= 0.7, (got_right.round(3), got_wrong.round(3))
    assert got_right.mean() > got_wrong.mean() + 0.3


# ---- the stage ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory, tiny_llm, tiny_checkpoint):
    """score_baselines on a small early set (3 ok questions, 1 failed) and a real-time set of continuations
    the tiny Llama generated (3 ok, 1 failed); yields the work directory."""
    work = tmp_path_factory.mktemp("score_baselines")
    prepare_llm(str(tiny_checkpoint), work / "data/llm")
    early = pd.DataFrame(
        [
            {"id": "q1", "status": "ok", "question": "The capital of France is", "answer": "Paris", "label": 0},
            {"id": "q2", "status": "ok", "question": "The capital of Spain is", "answer": "Lima", "label": 1},
            {"id": "q3", "status": "ValueError: empty question", "question": "", "answer": None, "label": None},
            {"id": "q4", "status": "ok", "question": "The river of Paris is", "answer": "the Seine", "label": 0},
        ]
    )
    prompts = ["The capital of France is", "The river of", "The capital of Peru is the city of", "The language of"]
    prompt_ids, traces = generate_traced(tiny_llm, prompts, [1], max_new_tokens=6, chat=False)
    rows = [
        {
            "id": f"a{k}",
            "status": "ok",
            "prompt_ids": p,
            "gen_ids": t.gen_ids,
            "prob": t.prob.tolist(),
            "entropy": t.entropy.tolist(),
        }
        for k, (p, t) in enumerate(zip(prompt_ids, traces))
    ]
    rows[2] = {
        "id": "a2",
        "status": "skipped: no entity",
        "prompt_ids": None,
        "gen_ids": None,
        "prob": None,
        "entropy": None,
    }
    for name, frame in (("early/early.parquet", early), ("realtime/realtime.parquet", pd.DataFrame(rows))):
        (work / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        frame.to_parquet(work / "data" / name, index=False)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["llm"].update(source=str(tiny_checkpoint), dtype="float32", device="cpu")
    params["score_baselines"]["evaluator"].update(template=TEMPLATE, chat=False, yes_words=["Y"], no_words=["N"])
    params["score_baselines"]["batch_size"] = 2
    params["retrorag"].update(yes_words=["Y"], no_words=["N"], chat=False, answer_tokens=4, reason_tokens=4)
    params["build_early"]["features"]["prompt"].update(template="{question}", chat=False)
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    previous = Path.cwd()
    os.chdir(work)
    try:
        score_baselines.main(["--params", "params.yaml"])
        yield work
    finally:
        os.chdir(previous)


def test_stage_writes_one_score_per_ok_question(stage_run, tiny_llm):
    table = pd.read_parquet(stage_run / "data/eval/baselines_early.parquet")
    assert table.columns.tolist() == ["id", "retrorag_self_evaluation", "retrorag_self_consistency"] and table[
        "id"
    ].tolist() == ["q1", "q2", "q4"]
    expected = self_evaluation_scores(tiny_llm, [("The capital of Spain is", "Lima")], TEMPLATE, yes=("Y",), no=("N",))
    assert table.loc[1, "retrorag_self_evaluation"] == pytest.approx(expected[0], rel=1e-4)
    params = yaml.safe_load((stage_run / "params.yaml").read_text())
    retrorag = load_section("retrorag", data=params)
    prompt = from_dict(PromptParams, params["build_early"]["features"]["prompt"], "prompt")
    # Eq. 1: a sampled a_sc
    consistency = self_consistency_scores(tiny_llm, ["The capital of Spain is"], ["Lima"], retrorag, prompt)
    assert table.loc[1, "retrorag_self_consistency"] == pytest.approx(consistency[0], rel=1e-4)
    assert table[["retrorag_self_evaluation", "retrorag_self_consistency"]].stack().between(0, 1).all()


def test_stage_writes_rind_aligned_with_each_continuation(stage_run, tiny_llm):
    records = pd.read_parquet(stage_run / "data/realtime/realtime.parquet").set_index("id")
    table = pd.read_parquet(stage_run / "data/eval/baselines_realtime.parquet")
    assert table["id"].tolist() == ["a0", "a1", "a3"]  # ok records only
    for row in table.itertuples():
        record = records.loc[row.id]
        assert len(row.rind) == len(record["prob"]) == len(record["gen_ids"]) > 0
        (alone,) = rind_scores(
            tiny_llm, [list(record["prompt_ids"])], [list(record["gen_ids"])], [list(record["entropy"])]
        )
        np.testing.assert_allclose(row.rind, alone.rind, rtol=1e-4, atol=1e-6)
    metrics = json.loads((stage_run / "data/metrics/score_baselines.json").read_text())
    assert metrics["retrorag"]["records"] == 3 and metrics["rind"]["records"] == 3
    assert metrics["rind"]["rind_tokens_per_s"] > 0 and metrics["rind"]["sdpa_forward_tokens_per_s"] > 0


def test_stage_refuses_a_set_without_the_columns_it_needs(stage_run):
    os.chdir(stage_run)
    pd.DataFrame([{"id": "q1", "status": "ok", "question": "x"}]).to_parquet("data/early/early.parquet", index=False)
    with pytest.raises(score_baselines.InputError, match=r"early.parquet has no column\(s\) \['answer'\]"):
        score_baselines.main(["--params", "params.yaml"])
