"""Query formulation (FLARE, DRAGIN QFS, DioR's importance score) with the tiny Llama, and DioR's post-retrieval
(stepwise selection, chunking) on hand-made passages."""

from __future__ import annotations

import re

import numpy as np
import pytest

from detectors.config.queries import DiorWeightsParams
from detectors.errors import InputError
from detectors.extensions import QUERIES
from detectors.llm.words import DEFAULT_STOPWORDS, word_mask, word_spans
from detectors.rag.context import chunk_passage, render_passages, stepwise_retrieve
from detectors.rag.corpus import Passage
from detectors.rag.families import make_query, make_trigger
from detectors.rag.queries import (
    CtrlAQuery,
    DiorQuery,
    FlareQuery,
    QfsQuery,
    QuestionQuery,
    dior_query,
    flare_query,
    importance_scores,
    qfs_query,
)
from detectors.rag.retriever import BM25Retriever

pytestmark = pytest.mark.gpu  # runs on $DYNRAG_TEST_DEVICE when set (tests/conftest.py)

BM25 = {"method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en", "stemmer": "english"}


def ids(llm, text: str) -> list[int]:
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_flare_drops_exactly_the_words_with_a_low_probability_token(tiny_llm):
    gen = ids(tiny_llm, " Paris is the capital")
    words = tiny_llm.tokenizer.convert_ids_to_tokens(gen)
    probs = np.full(len(gen), 0.9)
    probs[0] = 0.1  # the first token of " Paris"
    query = flare_query(tiny_llm.tokenizer, "The capital of France is", gen, probs, 0.5)
    assert query == "is the capital", (query, words)  # DRAGIN's Table 1: the last generated sentence, no question
    assert flare_query(tiny_llm.tokenizer, "Q", gen, np.full(len(gen), 0.9), 0.5) == "Paris is the capital"
    # nothing left after masking (a one-word answer FLARE doubts): the input itself, FLARE's first query
    assert (
        flare_query(tiny_llm.tokenizer, "The capital of France is", gen[:1], probs[:1], 0.5)
        == "The capital of France is"
    )


def test_words_decode_whole_even_when_a_character_spans_two_byte_tokens(tiny_llm):
    tok = tiny_llm.tokenizer
    gen = ids(tiny_llm, " Zürich is the city")
    assert any("\ufffd" in tok.decode([t]) for t in gen)  # the fixture's tokenizer splits ü over two byte tokens
    spans = word_spans(tok, gen)  # this tokenizer gives the leading space a token of its own: a word without content
    assert [text for _, text in spans] == [" ", "Zürich", " is", " the", " city"]
    assert [i for idx, _ in spans for i in idx] == list(range(len(gen)))  # every token once, in order
    content = {" ": False, "Zürich": True, " is": False, " the": False, " city": True}
    assert word_mask(tok, gen) == [content[text] for idx, text in spans for _ in idx]


def test_qfs_takes_context_words_in_text_order_without_stopwords(tiny_llm):
    from detectors.llm.layers import attention_implementation

    context = ids(tiny_llm, "The capital of Occitania is Toulouse and the currency of Japan is yen")
    before = tiny_llm.model.config._attn_implementation
    query = qfs_query(tiny_llm, context, len(context) - 1, 3, DEFAULT_STOPWORDS)
    text = tiny_llm.tokenizer.decode(context)
    words = query.split()
    assert 1 <= len(words) <= 3 and all(w in text for w in words)
    assert not any(w.lower() in DEFAULT_STOPWORDS for w in words)
    assert sorted(words, key=text.index) == words  # in text order
    assert tiny_llm.model.config._attn_implementation == before
    with pytest.raises(RuntimeError), attention_implementation(tiny_llm.model, "eager"):
        raise RuntimeError("restored after an error too")
    assert tiny_llm.model.config._attn_implementation == before


def test_dior_ranking_follows_the_weighted_component(tiny_llm):
    context = ids(tiny_llm, " Toulouse Paris peso yen Munich")
    candidates = ["Toulouse", "Paris", "peso", "yen", "Munich"]
    idf = {"Toulouse": 1.0, "Paris": 5.0, "peso": 2.0, "yen": 3.0, "Munich": 4.0}.get
    position = importance_scores(tiny_llm, "Q", context, candidates, DiorWeightsParams(0, 0, 1, 0), idf)
    assert list(np.argsort(-position)) == [4, 3, 2, 1, 0]  # the latest candidates first
    tfidf = importance_scores(tiny_llm, "Q", context, candidates, DiorWeightsParams(0, 1, 0, 0), idf)
    assert list(np.argsort(-tfidf)) == [1, 4, 3, 2, 0]  # the highest idf first
    query = dior_query(
        tiny_llm, "The capital of Bavaria is", context, candidates, DiorWeightsParams(0, 1, 0, 0), idf, 2
    )
    assert query == "The capital of Bavaria is Paris Munich"
    assert dior_query(tiny_llm, "Q", context, [], DiorWeightsParams(1, 1, 1, 1), idf, 2) == "Q"


CHAIN = [
    Passage("1", "Lumière", "The Lumière brothers were born in Besançon and founded the Lyon studio Cinématographe."),
    Passage("2", "Cinématographe", "The Cinématographe studio invented the projector in 1895."),
    Passage("3", "Besançon", "Besançon is a city of watchmakers."),
    Passage("4", "Brothers", "The Wright brothers flew the first airplane."),
    Passage("5", "Born", "Many artists were born in Paris."),
]


def test_stepwise_selection_finds_a_passage_that_only_a_found_concept_reaches():
    retriever = BM25Retriever.build(CHAIN, BM25)
    query = "Lumière brothers born"
    single = [h.passage.id for h in retriever.search(query, 2)]
    hits, queries = stepwise_retrieve(retriever, query, 2, retriever.idf)  # one query per search
    assert "2" not in single  # one batch of the question's terms misses the studio
    assert [h.passage.id for h in hits] == ["1", "2"] and [h.rank for h in hits] == [1, 2]
    assert queries[0] == query and len(queries) == 2 and "cinématographe" in queries[1].lower()


def test_chunks_never_cross_sentences_and_cover_the_text_once():
    text = (
        "Toulouse, the pink city, is the capital of Occitania. Its river, the Garonne, flows to Bordeaux; it is long."
    )
    blocks = chunk_passage(text, "capital of Occitania")
    assert " ".join(blocks).split() == text.split()
    first_sentence_end = text.index(".") + 1
    assert all(b not in text[:first_sentence_end] or b.endswith(".") or b in text[:first_sentence_end] for b in blocks)
    sentences = [
        "Toulouse, the pink city, is the capital of Occitania.",
        "Its river, the Garonne, flows to Bordeaux; it is long.",
    ]
    assert all(any(b in s for s in sentences) for b in blocks)  # every block inside one sentence
    # every clause brings query terms: one block
    assert chunk_passage("Occitania, capital Toulouse, pink city.", "capital of Occitania Toulouse pink city") == [
        "Occitania, capital Toulouse, pink city."
    ]
    # a clause without query terms starts a new block
    assert chunk_passage(
        "Occitania has Toulouse, which hosts many old buildings and several large museums.", "Occitania Toulouse"
    ) == [
        "Occitania has Toulouse,",
        "which hosts many old buildings and several large museums.",
    ]


def test_passages_render_as_numbered_blocks():
    from detectors.rag.retriever import Hit

    hits = [Hit(CHAIN[0], 1.0, 1), Hit(Passage("x", "", "No title here."), 0.5, 2)]
    plain = render_passages(hits, False, "q")
    assert plain == f"[1] Lumière: {CHAIN[0].text}\n[2] No title here."
    chunked = render_passages(hits, True, "Lumière brothers")
    assert (
        chunked.startswith("External Knowledge After Chunk:\n[1] Lumière: (1). ")
        and "\n[2] (1). No title here." in chunked
    )


WEIGHTS = {"attention": 0.1, "tfidf": 0.2, "position": 0.3, "similarity": 0.4}


# ---- the formulations by name (detectors.extensions.QUERIES) --------------------------------------------------


def test_each_query_formulation_is_built_by_name_with_its_own_settings(tiny_llm):
    """An entry reads its own settings (``rag_eval.query_settings.<name>``), the configuration's triggers (FLARE's
    threshold) and the retriever's idf; what it builds is what the loop ran before the formulations owned their
    settings (same objects, same settings), and each registered name is its formulation's own name."""
    settings = {"qfs": {"top_n": 3}, "dior": {"top": 2, "weights": WEIGHTS}}

    def idf(word: str) -> float:
        return 2.0

    flare = make_trigger("flare", tiny_llm, {"flare": 0.25})
    built = {name: make_query(name, settings, [flare], idf) for name in QUERIES}
    expected = {
        "question": QuestionQuery(),
        "flare": FlareQuery(0.75),  # words masked under 1 - FLARE's threshold
        "qfs": QfsQuery(3),
        "dior": DiorQuery(DiorWeightsParams(0.1, 0.2, 0.3, 0.4), 2, idf),
        "ctrla": CtrlAQuery(),
    }
    assert {name: built.get(name) for name in expected} == expected
    assert all(q.name == name for name, q in built.items())
    assert make_query("flare", settings) == FlareQuery(0.5)  # no FLARE trigger among the configuration's
    assert make_query("dior", settings).idf is None  # no retriever
    assert make_query("question") == QuestionQuery()  # an entry without settings needs none


def test_query_settings_are_checked_against_the_type_the_entry_declares():
    """Settings of the wrong shape, settings for a formulation that takes none, and a formulation that needs its
    settings without them: each one error naming the key and the fix."""
    with pytest.raises(InputError, match=r"rag_eval\.query_settings\.qfs\.top_n = 0: must be positive"):
        make_query("qfs", {"qfs": {"top_n": 0}})
    with pytest.raises(InputError, match=r"rag_eval\.query_settings\.dior\.weights\.tfidf = None: required key"):
        make_query("dior", {"dior": {"top": 2, "weights": {"attention": 1, "position": 0, "similarity": 0}}})
    with pytest.raises(InputError, match=r"rag_eval\.query_settings\.question: query formulation 'question' takes no"):
        make_query("question", {"question": {"top_n": 3}})
    with pytest.raises(InputError, match=r"query 'qfs' reads rag_eval\.query_settings\.qfs: give its settings"):
        make_query("qfs", {})


def test_an_unknown_query_formulation_is_one_error_naming_the_known_ones():
    known = re.escape(", ".join(sorted(QUERIES)))  # every registered formulation
    with pytest.raises(InputError, match=rf"^no query formulation named 'hyde'; known: {known}$"):
        make_query("hyde")
