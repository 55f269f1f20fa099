"""Corpora and the bm25s retriever on hand-made passages, and the index_corpus stage on the QA fixture."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from conftest import QA_FIXTURE, ROOT

from detectors.errors import InputError, SourceError
from detectors.rag.corpus import Passage, check_passages, jsonl_passages, qa_fact_passages, split_words
from detectors.rag.retriever import BM25Retriever, Retriever
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
    (tmp_path / "idx" / "passages.jsonl").write_text(
        (tmp_path / "idx" / "passages.jsonl").read_text().replace("Kenya", "Chile")
    )
    with pytest.raises(InputError, match=r"passages.jsonl is not the file that was written.*dvc repro index_corpus"):
        BM25Retriever.load(tmp_path / "idx")
    with pytest.raises(InputError, match="no bm25s index"):
        BM25Retriever.load(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"id": 1, "text": "ok"}', "not json"], "line 2 is not JSON"),
        (['{"id": 1, "body": "no text field"}'], "line 1 has no field 'text'"),
        (['{"id": 1, "text": "   "}'], "line 1: field 'text' is empty"),
        (['["a", "list"]'], "line 1 is not a JSON object"),
    ],
)
def test_bad_passage_files_are_refused_naming_the_line_and_field(tmp_path, lines, match):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError, match=match):
        jsonl_passages(path, "id", None, "text")


def test_empty_corpora_and_duplicate_ids_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SourceError, match="holds no passage"):
        check_passages(jsonl_passages(tmp_path / "empty.jsonl", None, None, "text"), "corpus x")
    with pytest.raises(SourceError, match="'a' occurs twice"):
        check_passages([PASSAGES[0], PASSAGES[0]], "corpus x")
    with pytest.raises(InputError, match="empty corpus"):
        BM25Retriever.build([], BM25)


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


def test_the_index_corpus_stage_writes_each_index_and_the_answer_recall(tmp_path):
    qa = _fixture_qa()
    data = tmp_path / "data"
    (data / "prepared").mkdir(parents=True)
    qa.to_parquet(data / "prepared" / "qa.parquet")
    passages = tmp_path / "passages.jsonl"
    passages.write_text("".join(json.dumps({"pid": p.id, "text": p.text}) + "\n" for p in PASSAGES))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["paths"] = {k: str(tmp_path / v) for k, v in params["paths"].items()}
    params["index_corpus"]["corpora"] = {
        "facts": {"source": "qa", "id_field": None, "title_field": None, "text_field": None},
        "mine": {"source": str(passages), "id_field": "pid", "title_field": None, "text_field": "text"},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.index_corpus", "--params", str(tmp_path / "params.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "data/metrics/index_corpus.json").read_text())
    assert report["facts"]["passages"] == len(qa) and report["mine"]["passages"] == 3
    assert report["facts"]["answer_recall@1"] >= 0.9 and report["mine"]["answer_recall@10"] < 0.5
    assert BM25Retriever.load(tmp_path / "data/rag/index/mine").search("Isar", 1)[0].passage.id == "b"
    params["index_corpus"]["corpora"]["mine"]["text_field"] = "body"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    bad = subprocess.run(
        [sys.executable, "-m", "pipelines.index_corpus", "--params", str(tmp_path / "params.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "has no field 'body'" in bad.stderr and "Traceback" not in bad.stderr


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
