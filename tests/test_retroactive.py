"""RetroRAG with the tiny Llama: Eq. 1's self-consistency score with a sampled second answer, and the retroactive
loop (evidence collation, the answerer's consistency check, evidence discovery through both gates, the re-query),
iterated until the answer is consistent; a question's answer and samples never depend on the questions beside it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from conftest import ROOT, qa_rows

from detectors.baselines.retrorag import self_consistency_scores
from detectors.config import load_section
from detectors.config.core import ParamsError, from_dict
from detectors.config.retrorag import RetroRagParams
from detectors.config.schema import PromptParams
from detectors.extensions import FRAMEWORKS
from detectors.llm.generate import generate, instruction_prompt, row_generator
from detectors.llm.judge import yes_no_ids, yes_probability
from detectors.rag.corpus import Passage
from detectors.rag.retriever import BM25Retriever, Hit
from detectors.rag.retroactive import Evidence, RetroRag, keep_top, merge_evidence, split_candidates, truncate_words

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
PROMPT = PromptParams(template="{question}", chat=False, system=None)  # as the tiny Llama learnt its facts
# the shipped prompts, with evidence blocks the tiny Llama can read, words it has as single tokens and short generations
# (its context is 256 positions)
RETRO = from_dict(
    RetroRagParams,
    {
        **PARAMS["retrorag"],
        "answer_context": "{evidence}\n",
        "direct_context": "{evidence}\n",
        "yes_words": ["Y"],
        "no_words": ["N"],
        "chat": False,
        "k": 2,
        "top_n": 2,
        "top_k_inferential": 2,
        "max_iterations": 3,
        "answer_tokens": 4,
        "reason_tokens": 6,
        "evidence_tokens": 5,
        "evidence_words": 8,
    },
    "retrorag",
    strict=True,
)
PASSAGES = [
    Passage("p1", "Occitania", "The capital of Occitania is Toulouse, the pink city."),
    Passage("p2", "Bavaria", "The capital of Bavaria is Munich, on the river Isar."),
    Passage("p3", "Kenya", "The capital of Kenya is Nairobi, on the Athi plains."),
]
QUESTIONS = ["The capital of Kenya is", "The capital of Occitania is", "The capital of Bavaria is"]


@pytest.fixture(scope="module")
def retriever() -> BM25Retriever:
    return BM25Retriever.build(PASSAGES, PARAMS["index_corpus"]["bm25"])


def comparable(result) -> dict:
    out = dataclasses.asdict(result)
    out.pop("wall_s")
    for r in out["retrievals"]:
        r["score"] = None if r["score"] != r["score"] else round(r["score"], 4)  # nan: the first retrieval
    return out


# ---- Eq. 1 on the early set's answers --------------------------------------------------------------------------


def test_self_consistency_is_eq1_with_a_sampled_second_answer(tiny_llm):
    """a_sc is sampled from the question prompt with the question's own random stream, and M_sc judges whether it means
    what the answer says; the samples (hence the scores) do not depend on the batch or the order of the questions."""
    questions = [r["question"] for r in qa_rows()[:6]]
    prompts = [tiny_llm.render(q, PROMPT)[0] for q in questions]
    greedy = [g.text for g in generate(tiny_llm, prompts, RETRO.answer_tokens, batch_size=6)]
    scores = self_consistency_scores(tiny_llm, questions, greedy, RETRO, PROMPT, batch_size=4)
    yes, no = yes_no_ids(tiny_llm.tokenizer, ["Y"], ["N"])
    for question, prompt, answer, score in zip(questions, prompts, greedy, scores):
        sample = generate(
            tiny_llm,
            [prompt],
            RETRO.answer_tokens,
            generators=[row_generator(RETRO.seed, question, 0)],
            temperature=1.0,
        )[0]
        judged = RETRO.consistency_template.format(question=question, answer=answer, sc_answer=sample.text)
        assert score == pytest.approx(float(yes_probability(tiny_llm, [judged], yes, no)[0]), abs=1e-5)
    reverse = self_consistency_scores(tiny_llm, questions[::-1], greedy[::-1], RETRO, PROMPT, batch_size=1)
    assert reverse[::-1] == pytest.approx(scores, abs=1e-5)
    # the sampler: near temperature 0 it is greedy decoding; at 1 it samples other answers
    cold = generate(
        tiny_llm, prompts, RETRO.answer_tokens, generators=[row_generator(0, q) for q in questions], temperature=1e-4
    )
    assert [g.text for g in cold] == greedy
    hot = generate(
        tiny_llm, prompts, RETRO.answer_tokens, generators=[row_generator(0, q) for q in questions], temperature=1.0
    )
    assert [g.text for g in hot] != greedy


# ---- the retroactive loop --------------------------------------------------------------------------------------


def test_a_consistent_answer_stands_after_one_retrieval(tiny_llm, retriever):
    """s_sc > threshold (every s_sc is > -1): one iteration; the answer is the first line of the answer-generator's
    greedy continuation with the collated evidence before the question, and nothing is discovered or re-queried."""
    rag = RetroRag(tiny_llm, retriever, dataclasses.replace(RETRO, threshold=-1.0), PROMPT, batch_size=3)
    states = rag.run(QUESTIONS)
    for state in states:
        (it,) = state.iterations
        assert [r.queries for r in state.retrievals] == [[state.question]] and it.next_query is None and not it.inferred
        assert it.retrieved == [h.passage.id for h in retriever.search(state.question, RETRO.k)]
        assert [e.id for e in it.source] == [
            e.id for e in keep_top(it.candidates, [e.score for e in it.candidates], RETRO.top_n)
        ]
        block = RETRO.answer_context.format(
            evidence="\n".join(
                f"[{i}] {truncate_words(e.text, RETRO.evidence_words)}" for i, e in enumerate(it.source, start=1)
            )
        )
        said = generate(tiny_llm, [tiny_llm.render(block + state.question, PROMPT)[0]], RETRO.reason_tokens, stop=())[0]
        assert state.answer == rag.answer_text(said.ids) and it.answer == state.answer
        assert state.passes > 0 and state.generated > 0


def test_an_inconsistent_answer_goes_back_with_the_requery_until_the_last_iteration(tiny_llm, retriever):
    """s_sc never exceeds 1: every question runs max_iterations; iteration L retrieves with the search query that
    iteration L-1's re-query generator wrote, and matches evidence against q + " " + q_s."""
    once = RetroRag(tiny_llm, retriever, dataclasses.replace(RETRO, threshold=-1.0), PROMPT).answer_all(QUESTIONS)
    rag = RetroRag(tiny_llm, retriever, dataclasses.replace(RETRO, threshold=1.0), PROMPT, batch_size=3)
    states = rag.run(QUESTIONS)
    for state, first in zip(states, once):
        assert len(state.iterations) == RETRO.max_iterations == len(state.retrievals)
        for before, it, retrieval in zip(state.iterations, state.iterations[1:], state.retrievals[1:]):
            assert before.next_query and retrieval.queries == [before.next_query] == [it.search_query]
            assert it.matching_query == f"{state.question} {before.next_query}"
            assert retrieval.score == pytest.approx(before.consistency)  # the s_sc that sent the question back
        assert state.iterations[-1].next_query is None and state.answer == state.iterations[-1].answer
        result = state.result()
        assert result.forward_passes > first.forward_passes and result.generated_tokens > first.generated_tokens


def test_inferred_evidence_is_kept_only_when_both_gates_pass(tiny_llm, retriever):
    """Eq. 3: a candidate survives when s_qr and s_ra both exceed the gate. At gate 1 none can; at gate 0 (every
    evaluator score is > 0) all do, the top_k_inferential best by M_e against q are kept (Eq. 4) and the next
    iteration's answerer sees them after the source evidence."""
    params = dataclasses.replace(RETRO, threshold=1.0, max_iterations=2)
    closed = RetroRag(tiny_llm, retriever, dataclasses.replace(params, gate=1.0), PROMPT).run(QUESTIONS)
    assert all(s.iterations[0].inferred and not s.iterations[0].inferential and not s.inferential for s in closed)
    open_ = RetroRag(tiny_llm, retriever, dataclasses.replace(params, gate=0.0), PROMPT).run(QUESTIONS)
    for state in open_:
        first, second = state.iterations
        candidates = [c for c, _, _ in first.inferred]
        assert candidates and [e.text for e in first.inferential] == [
            e.text
            for e in keep_top(
                [Evidence(c, c) for c in candidates], [state.relevance[c] for c in candidates], RETRO.top_k_inferential
            )
        ]
        assert [e.id for e in second.evidence] == [e.id for e in second.source] + [
            e.id for e in first.inferential if e.text not in {s.text for s in second.source}
        ]


def test_answers_and_samples_do_not_depend_on_the_batch(tiny_llm, retriever):
    params = dataclasses.replace(RETRO, threshold=0.5)
    together = RetroRag(tiny_llm, retriever, params, PROMPT, batch_size=3).answer_all(QUESTIONS, record_prompts=True)
    alone = RetroRag(tiny_llm, retriever, params, PROMPT, batch_size=1).answer_all(
        QUESTIONS[::-1], record_prompts=True
    )[::-1]
    assert [comparable(r) | {"forward_passes": 0} for r in together] == [
        comparable(r) | {"forward_passes": 0} for r in alone
    ]
    assert all(r.prompts for r in together)  # every LLM call's prompt, recorded


def test_a_question_without_passages_is_answered_and_says_so(tiny_llm):
    empty = BM25Retriever.build([Passage("x", "Mars", "Olympus Mons is a volcano.")], PARAMS["index_corpus"]["bm25"])
    (result,) = RetroRag(tiny_llm, empty, dataclasses.replace(RETRO, threshold=-1.0), PROMPT).answer_all(["zzzz"])
    assert result.error == "no passage retrieved" and result.retrievals[0].passage_ids == []


# ---- evidence bookkeeping and params ---------------------------------------------------------------------------


def test_evidence_collation_merges_by_id_and_keeps_the_best_stored_first_on_ties():
    stored = [Evidence("p1", "Occitania: The capital of Occitania is Toulouse, the pink city.", 0.9)]
    hits = [Hit(PASSAGES[0], 3.0, 0), Hit(PASSAGES[2], 1.0, 1)]
    merged = merge_evidence(stored, hits)
    assert [e.id for e in merged] == ["p1", "p3"] and merged[1].text == "Kenya: " + PASSAGES[2].text
    assert [e.id for e in keep_top(merged, [0.5, 0.5], 1)] == ["p1"]
    assert [(e.id, e.score) for e in keep_top(merged, [0.2, 0.7], 2)] == [("p3", 0.7), ("p1", 0.2)]
    assert split_candidates(' Toulouse is pink # "Toulouse is pink" #  # Munich\nignored # line') == [
        "Toulouse is pink",
        "Munich",
    ]
    assert truncate_words("a b c d", 2) == "a b ..." and truncate_words("a b", 2) == "a b"


def test_instructions_are_a_user_turn_when_chat(tiny_llm):
    assert instruction_prompt(tiny_llm, "Is it? Y or N", False) == "Is it? Y or N"
    assert instruction_prompt(tiny_llm, "Is it? Y or N", True) == "<s>user\nIs it? Y or N</s>\n<s>assistant\n"


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        (
            "retrorag",
            "consistency_template",
            "{question} {answer}",
            r"retrorag.consistency_template = .*must contain \{sc_answer\} exactly once",
        ),
        (
            "retrorag",
            "requery_template",
            "{question} {reference} {evidence} {reason} {oops}",
            r"only \{question\}, .* may be in braces",
        ),
        ("retrorag", "reason_tokens", 2, r"retrorag.reason_tokens = 2: must be >= answer_tokens \(8\)"),
        ("retrorag", "gate", 1.5, r"retrorag.gate = 1.5: an evaluator score threshold must be in \[0, 1\]"),
        (
            "rag_eval",
            "frameworks",
            ["selfrag"],
            rf"rag_eval.frameworks\[0\] = 'selfrag': no framework of that name; "
            rf"known: {re.escape(', '.join(sorted(FRAMEWORKS)))}$",
        ),
        (
            "rag_eval",
            "configurations",
            {
                "retrorag": {
                    "triggers": ["always"],
                    "query": "question",
                    "stepwise": False,
                    "chunk": False,
                    "steering": None,
                    "context": None,
                }
            },
            r"rag_eval.frameworks\[0\] = 'retrorag': a configuration has this name too",
        ),
    ],
)
def test_bad_retrorag_params_are_refused_naming_the_key(section, key, value, message):
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data[section][key] = value
    with pytest.raises(ParamsError, match=message):
        load_section(section, data=data)
