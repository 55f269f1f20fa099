"""Corpora and the bm25s retriever on hand-made passages, and the index_corpus stage on the QA fixture.

Today's results are the reference: the digests below were written by the retriever before the streaming build (the
whole corpus tokenized and indexed by ``bm25s.BM25.index`` at once, at 183626a), and :func:`todays_hits` is its search
(bm25s's ``get_scores`` over every passage, a full sort)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import QA_FIXTURE, ROOT

from detectors.errors import InputError, SourceError
from detectors.rag import bm25_search
from detectors.rag.bm25_build import import_bm25s
from detectors.rag.corpus import JsonlPassages, Passage, PassageList, ovos_passages, qa_fact_passages, split_words
from detectors.rag.retriever import ENGINES, BM25Retriever, IndexError_, Retriever, TermStatistics, open_index
from detectors.sources.text import contains_reference

BM25 = {"method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en", "stemmer": "english"}
PASSAGES = [
    Passage("a", "Toulouse", "Toulouse is the capital of Occitania, in southern France."),
    Passage("b", "Munich", "Munich is the capital of Bavaria and lies on the river Isar."),
    Passage("c", "Nairobi", "Nairobi is the capital city of Kenya."),
]


@pytest.fixture(scope="module")
def retriever() -> BM25Retriever:
    return BM25Retriever.build(PASSAGES, BM25)


def test_passages_are_whole_sentences_of_at_most_the_word_limit():
    text = "One two three. Four five six seven. Eight nine, i.e. ten eleven twelve. Thirteen."
    assert split_words(text, 7) == [
        "One two three. Four five six seven.",
        "Eight nine, i.e. ten eleven twelve. Thirteen.",
    ]
    assert split_words(text, 6) == [
        "One two three.",
        "Four five six seven.",
        "Eight nine, i.e. ten eleven twelve.",
        "Thirteen.",
    ]
    assert split_words("A very long sentence of nine words right here.", 4) == [
        "A very long sentence of nine words right here."
    ]
    assert split_words(text, 100) == [text]


def test_the_passage_that_holds_the_query_terms_ranks_first(retriever):
    assert isinstance(retriever, Retriever)
    hits = retriever.search("What is the capital of Bavaria?", 3)
    assert [h.passage.id for h in hits][0] == "b" and [h.rank for h in hits] == list(range(1, len(hits) + 1))
    assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))
    assert retriever.search("rivers of Bavaria", 10)[0].passage.id == "b"  # stemming: rivers ~ river
    assert len(retriever.search("capital", 10)) == 3  # k beyond the corpus is fine
    assert retriever.batch_search(["Kenya", "Occitania"], 1) == [
        retriever.search("Kenya", 1),
        retriever.search("Occitania", 1),
    ]


def test_a_query_without_indexed_terms_retrieves_nothing(retriever):
    assert retriever.search("of the and is", 3) == []
    assert retriever.search("zebra quantum", 3) == []
    assert retriever.idf("the") == 0.0 and retriever.idf("zebra") == 0.0
    assert retriever.idf("Kenya") > retriever.idf("capital") > 0


def test_ties_are_broken_by_passage_order():
    twins = [Passage(str(i), "", "Lyon is a city in France.") for i in range(4)]
    hits = BM25Retriever.build(twins, BM25).search("Lyon", 4)
    assert [h.passage.id for h in hits] == ["0", "1", "2", "3"]


def test_save_and_load_give_the_same_hits_and_a_tampered_index_is_refused(retriever, tmp_path):
    manifest = retriever.save(tmp_path / "idx")
    assert manifest["passages"] == 3 and manifest["digest"] == retriever.digest
    loaded = BM25Retriever.load(tmp_path / "idx")
    for q in ["capital of Kenya", "Isar", "southern France"]:
        assert loaded.search(q, 3) == retriever.search(q, 3)
    assert loaded.digest == retriever.digest
    assert list(loaded.passages) == PASSAGES and loaded.passages[-1] == PASSAGES[-1]  # read back by offset
    assert loaded.passages[1:] == PASSAGES[1:]
    (tmp_path / "idx" / "passages.jsonl").write_text(
        (tmp_path / "idx" / "passages.jsonl").read_text().replace("Kenya", "Chile")
    )
    with pytest.raises(InputError, match=r"passages.jsonl is not the file that was written.*dvc repro index_corpus"):
        BM25Retriever.load(tmp_path / "idx")
    with pytest.raises(InputError, match="no index"):
        BM25Retriever.load(tmp_path / "nowhere")


def test_an_index_opens_through_the_engine_its_manifest_names(retriever, tmp_path):
    retriever.save(tmp_path / "idx")
    opened = open_index(tmp_path / "idx")
    assert isinstance(opened, BM25Retriever) and isinstance(opened, Retriever) and isinstance(opened, TermStatistics)
    assert opened.search("Isar", 1) == retriever.search("Isar", 1)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps({**manifest, "engine": "elasticsearch"}))
    known = re.escape(", ".join(sorted(ENGINES)))  # every registered engine
    with pytest.raises(IndexError_, match=rf"^no retrieval engine named 'elasticsearch'; known: {known}$"):
        open_index(tmp_path / "idx")
    del manifest["derived"]  # an index written before the derived files: rebuilt, not misread
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexError_, match="built by an earlier version.*dvc repro index_corpus"):
        open_index(tmp_path / "idx")


def test_malformed_and_empty_passages_are_skipped_and_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        '{"id": 1, "text": "Toulouse is in Occitania."}',
        "not json",
        "",
        '{"id": 2, "body": "no text field"}',
        '{"id": 3, "text": "   "}',
        '{"id": 4, "text": null}',
        '["a", "list"]',
        '{"id": 5, "text": "Munich lies \u2028on the Isar."}',
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    index = BM25Retriever.build(JsonlPassages(path, None, None, "text"), BM25)
    assert [(p.id, p.text) for p in index.passages] == [
        ("1", "Toulouse is in Occitania."),
        ("8", "Munich lies \u2028on the Isar."),  # ids: line numbers; a line is cut at "\n" only
    ]
    assert index.manifest["build"]["skipped"] == {
        "not JSON": 1,
        "no field 'text'": 1,
        "empty text": 2,
        "not a JSON object": 1,
    }
    assert "line 2 is not JSON" in index.manifest["build"]["skipped_examples"]["not JSON"]
    assert index.search("Isar", 1)[0].passage.id == "8"


@pytest.mark.parametrize(
    "lines, match",
    [
        (
            ['{"id": 1, "body": "no text field"}'],
            r"no passage.*line 1 has no field 'text' \(fields: \['body', 'id'\]\)",
        ),
        (['{"id": 1, "text": "   "}', "not json"], r"no passage; records skipped \(empty text: 1, not JSON: 1\)"),
        (["", "  "], "holds no passage$"),
    ],
)
def test_a_source_without_a_passage_is_refused_naming_why(tmp_path, lines, match):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError, match=match):
        BM25Retriever.build(JsonlPassages(path, "id", None, "text"), BM25)


def test_empty_corpora_duplicate_ids_and_wordless_corpora_are_refused(tmp_path):
    with pytest.raises(SourceError, match="holds no passage"):
        BM25Retriever.build([], BM25)
    with pytest.raises(SourceError, match="'a' occurs twice"):
        BM25Retriever.build([PASSAGES[0], PASSAGES[1], PASSAGES[0]], BM25, chunk=2)  # across chunks too
    with pytest.raises(InputError, match="no indexable word"):
        BM25Retriever.build([Passage("x", "", "the of and")], BM25)
    with pytest.raises(SourceError, match="does not exist"):
        JsonlPassages(tmp_path / "nowhere.jsonl", "id", None, "text")


def _fixture_qa() -> pd.DataFrame:
    from detectors.sources.ids import split_of
    from detectors.sources.qa import load_raw, normalize_records

    table, _ = normalize_records(load_raw(str(QA_FIXTURE), "."), str(QA_FIXTURE))
    table["split"] = table["id"].map(lambda i: split_of(i, {"train": 0.5, "val": 0.2, "test": 0.3}))
    return table


def test_every_question_retrieves_its_own_fact_from_the_facts_corpus():
    qa = _fixture_qa()
    passages = qa_fact_passages(qa)
    assert len(passages) == len(qa) and all(p.text.endswith(".") for p in passages)
    retriever = BM25Retriever.build(passages, BM25)
    for row in qa.itertuples():
        top = retriever.search(row.question, 1)[0].passage
        assert top.id == str(row.id) and contains_reference(top.text, list(row.answers)), (row.question, top)


def _index_corpus(tmp_path, params: dict) -> subprocess.CompletedProcess:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return subprocess.run(
        [sys.executable, "-m", "pipelines.index_corpus", "--params", str(tmp_path / "params.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def test_the_index_corpus_stage_writes_each_index_and_the_answer_recall_and_rebuilds_only_what_changed(tmp_path):
    qa = _fixture_qa()
    data = tmp_path / "data"
    (data / "prepared").mkdir(parents=True)
    qa.to_parquet(data / "prepared" / "qa.parquet")
    passages = tmp_path / "passages.jsonl"
    passages.write_text("".join(json.dumps({"pid": p.id, "text": p.text}) + "\n" for p in PASSAGES) + '{"pid": 9}\n')
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["paths"] = {k: str(tmp_path / v) for k, v in params["paths"].items()}
    params["index_corpus"]["corpora"] = {
        "facts": {"source": "qa", "id_field": None, "title_field": None, "text_field": None},
        "mine": {"source": str(passages), "id_field": "pid", "title_field": None, "text_field": "text"},
    }
    done = _index_corpus(tmp_path, params)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "data/metrics/index_corpus.json").read_text())
    assert report["facts"]["passages"] == len(qa) and report["mine"]["passages"] == 3
    assert report["mine"]["skipped"] == {"no field 'text'": 1} and report["facts"]["skipped"] == {}
    assert report["facts"]["answer_recall@1"] >= 0.9 and report["mine"]["answer_recall@10"] < 0.5
    assert report["facts"]["built"] and report["mine"]["built"]
    assert report["facts"]["digest"] == TODAYS_DIGESTS["facts"]["lucene"]
    assert open_index(tmp_path / "data/rag/index/mine").search("Isar", 1)[0].passage.id == "b"

    again = _index_corpus(tmp_path, params)  # nothing changed: nothing is built
    assert again.returncode == 0, again.stderr
    kept = json.loads((tmp_path / "data/metrics/index_corpus.json").read_text())
    assert not kept["facts"]["built"] and not kept["mine"]["built"]
    for name in ("facts", "mine"):  # the same index, report and recall
        assert {**kept[name], "built": True} == report[name]

    qa.iloc[:-1].to_parquet(data / "prepared" / "qa.parquet")  # new QA facts: `facts` is built again, `mine` kept
    changed = _index_corpus(tmp_path, params)
    assert changed.returncode == 0, changed.stderr
    report = json.loads((tmp_path / "data/metrics/index_corpus.json").read_text())
    assert report["facts"]["built"] and report["facts"]["passages"] == len(qa) - 1 and not report["mine"]["built"]

    del params["index_corpus"]["corpora"]["facts"]  # a corpus no longer configured is removed
    served = tmp_path / "data/rag/index/served"  # an index of another engine, put there by hand, is kept
    served.mkdir()
    (served / "manifest.json").write_text(json.dumps({"engine": "elasticsearch", "digest": "x"}))
    params["index_corpus"]["corpora"]["mine"]["text_field"] = "body"
    bad = _index_corpus(tmp_path, params)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "holds no passage; records skipped (no field 'body': 4), the first:" in bad.stderr
    assert "line 1 has no field 'body' (fields: ['pid', 'text'])" in bad.stderr
    assert sorted(p.name for p in (tmp_path / "data/rag/index").iterdir()) == [".building", "mine", "served"]


def test_the_index_files_are_byte_identical_whatever_the_hash_seed(tmp_path):
    """bm25s numbers its vocabulary in set order; the retriever sorts it, so the digest rag_eval records is stable."""
    code = (
        "import sys; from detectors.rag.corpus import Passage; from detectors.rag.retriever import BM25Retriever;"
        f"P = [Passage(str(i), '', t) for i, t in enumerate({[p.text for p in PASSAGES] * 3!r})];"
        f"print(BM25Retriever.build(P, {BM25!r}).save(sys.argv[1])['digest'])"
    )
    digests = set()
    for seed in ("1", "2", "3"):
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / seed)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
        )
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_the_retriever_imports_bm25s_without_starting_jax(tmp_path):
    """Where JAX is installed, bm25s runs a JAX top-k when imported, which starts JAX on the GPU and takes 75 % of
    its memory (an H100 run of the tests ran out of memory that way). A package named jax stands in for it here,
    recording that it was imported: building and searching an index never imports it, and it stays importable."""
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(tmp_path / 'imported')!r}).write_text('jax')\n"
    )
    code = (
        "import sys\n"
        "from detectors.rag.corpus import Passage\n"
        "from detectors.rag.retriever import BM25Retriever\n"
        f"index = BM25Retriever.build([Passage('a', 'Toulouse', 'Toulouse is in Occitania.')], {BM25!r})\n"
        "assert [h.passage.id for h in index.search('Occitania', 1)] == ['a']\n"
        "import bm25s.selection\n"
        "print(bm25s.selection.JAX_IS_AVAILABLE, 'jax' in sys.modules, flush=True)\n"
        "import jax\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]  # bm25s selects with numpy; JAX was not imported by it
    assert (tmp_path / "imported").read_text() == "jax"  # the caller's own `import jax` still works


# ---- today's results, exactly ----------------------------------------------------------------------------------
# the digests the retriever before the streaming build wrote (183626a; data/rag/index in dvc.lock for `wiki`)
TODAYS_DIGESTS = {
    "wiki": "1cf9cc10ad6bc479",
    "facts": {
        "lucene": "d46833749279c70e",
        "robertson": "cee66d6118dbe3c5",
        "atire": "414d17ecd687e472",
        "bm25l": "4f7a79e559cdea44",
        "bm25+": "f47a529eac4aa15e",
    },
}


def todays_hits(directory, params: dict, queries: list[str], k: int) -> list[list[tuple[str, float, int]]]:
    """The search of the retriever before this one, over the index files in ``directory``: bm25s's scores of every
    passage (``BM25.get_scores``), in float64, fully sorted by score descending, then passage order."""
    bm25s = import_bm25s()
    index = bm25s.BM25.load(str(directory / "bm25s"))
    ids = [json.loads(line)["id"] for line in (directory / "passages.jsonl").read_bytes().split(b"\n") if line]
    df = json.loads((directory / "document_frequency.json").read_text())
    stem = __import__("Stemmer").Stemmer(params["stemmer"])
    out = []
    for query in queries:
        terms = bm25s.tokenize([query], stopwords=params["stopwords"], stemmer=stem, return_ids=False)[0]
        terms = [t for t in terms if t in df]
        if not terms:
            out.append([])
            continue
        scores = np.asarray(index.get_scores(terms), dtype=np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        out.append([(ids[i], float(scores[i]), r + 1) for r, i in enumerate(order) if scores[i] > 0])
    return out


def _hits(retriever: BM25Retriever, queries: list[str], k: int) -> list[list[tuple[str, float, int]]]:
    return [[(h.passage.id, h.score, h.rank) for h in found] for found in retriever.batch_search(queries, k)]


def _queries(passages: list[Passage], questions: list[str]) -> list[str]:
    """The questions, DRAGIN-length queries (the first 35 words of every 7th passage), repeated words (a term counts
    twice), words of no passage and stop words only."""
    long = [" ".join(p.text.split()[:35]) for p in passages[::7]]
    return [*questions, *long, "capital capital of France", "zebra quantum", "the of and", ""]


@pytest.mark.parametrize("method", list(TODAYS_DIGESTS["facts"]))
def test_the_facts_corpus_gives_todays_index_and_hits_for_every_bm25_variant(method, tmp_path):
    """The QA facts as the default `facts` corpus is built, in chunks of 7 passages: the same bytes as the build
    that tokenized and indexed them at once, and the same hits as a full sort of every passage's score (bm25l and
    bm25+ give every passage a score, so passages no query term reaches rank too)."""
    qa = _fixture_qa()
    passages = qa_fact_passages(qa)
    params = {**BM25, "method": method}
    built = BM25Retriever.build(passages, params, tmp_path / "idx", chunk=7)
    assert built.digest == TODAYS_DIGESTS["facts"][method]
    queries = _queries(passages, list(qa["question"]))
    for k in (1, 3, len(passages) + 5):
        assert _hits(built, queries, k) == todays_hits(tmp_path / "idx", params, queries, k)


def test_the_wiki_corpus_gives_todays_index_and_hits(tmp_path, monkeypatch):
    """The default `wiki` corpus (12,372 passages of the ovos summaries), in one chunk and in chunks of 1000: the
    digest the pipeline recorded before, and the hits of a full sort for the QA fixture's questions and 1,768
    DRAGIN-length queries, at k = 3 and 10, searched one by one and in batches on 1 and 2 threads."""
    monkeypatch.setattr(bm25_search, "PARALLEL_MIN_PASSAGES", 0)  # batches on threads even for 12,372 passages
    passages = ovos_passages()
    whole = BM25Retriever.build(passages, BM25, tmp_path / "whole")
    chunked = BM25Retriever.build(PassageList(passages), BM25, tmp_path / "chunked", chunk=1000)
    assert whole.digest == chunked.digest == TODAYS_DIGESTS["wiki"]
    queries = _queries(passages, list(_fixture_qa()["question"]))
    for k in (3, 10):
        today = todays_hits(tmp_path / "whole", BM25, queries, k)
        chunked.threads = 1
        assert _hits(chunked, queries, k) == today
        chunked.threads = 2
        assert _hits(chunked, queries, k) == today
    assert [[(h.passage.id, h.score, h.rank) for h in chunked.search(q, 3)] for q in queries[:40]] == todays_hits(
        tmp_path / "whole", BM25, queries[:40], 3
    )


class Interrupted(PassageList):
    """A source that fails after ``fail_after`` records (a crash), and records where each read started."""

    def __init__(self, passages, fail_after=None):
        super().__init__(passages)
        self.fail_after, self.starts = fail_after, []

    def read(self, start=(0, 0)):
        self.starts.append(start)
        for n, item in enumerate(super().read(start)):
            if self.fail_after is not None and n == self.fail_after:
                raise RuntimeError("killed")
            yield item


def test_an_interrupted_build_resumes_after_its_last_chunk_and_gives_the_same_index(tmp_path):
    passages = qa_fact_passages(_fixture_qa())
    crashing = Interrupted(passages, fail_after=17)
    with pytest.raises(RuntimeError, match="killed"):
        BM25Retriever.build(crashing, BM25, tmp_path / "idx", tmp_path / "work", chunk=5)
    assert not (tmp_path / "idx" / "manifest.json").exists()  # no index until it is complete
    (tmp_path / "idx" / "passages.jsonl").open("ab").write(b'{"half": "a line')  # a crash mid-write
    (tmp_path / "idx" / "manifest.json.part").write_text("{")  # or while writing the manifest
    again = Interrupted(passages)
    resumed = BM25Retriever.build(again, BM25, tmp_path / "idx", tmp_path / "work", chunk=5)
    assert again.starts == [(15, 15)]  # three chunks of 5 were done: read on from the 16th passage
    assert resumed.digest == TODAYS_DIGESTS["facts"]["lucene"] and not (tmp_path / "work").exists()
    with pytest.raises(RuntimeError, match="killed"):
        BM25Retriever.build(Interrupted(passages, fail_after=12), BM25, tmp_path / "idx2", tmp_path / "work2", chunk=5)
    other = Interrupted(passages[:-1])  # another source in the same place: its work is not reused
    assert BM25Retriever.build(other, BM25, tmp_path / "idx2", tmp_path / "work2", chunk=5).manifest["passages"] == 47
    assert other.starts == [(0, 0)]
