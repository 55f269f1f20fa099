"""Stage index_corpus: a bm25s index per passage corpus of ``index_corpus.corpora`` under ``paths.rag_index/<name>/``.

Each directory holds the passages (``passages.jsonl``), the index and ``manifest.json`` with the hashes of both
(``rag_eval`` records the digest with its results). ``paths.index_report`` gives per corpus the passages, vocabulary,
digest and build time, and the retriever's **answer recall@k**: how often one of the top k passages for a QA test
question (the question as the query) holds a reference answer. It tells a weak corpus from a weak trigger.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pandas as pd

from detectors.evaluation.answer_metrics import answer_recall
from detectors.io import write_json
from detectors.rag.corpus import OVOS, QA, check_passages, jsonl_passages, ovos_passages, qa_fact_passages
from detectors.rag.retriever import BM25Retriever
from pipelines._stage import run, stage_params

log = logging.getLogger("index_corpus")
READS = ("index_corpus", "paths.qa", "paths.rag_index", "paths.index_report")
DEPS = ("${paths.qa}",)
OUTS = (
    "${paths.rag_index}",
    ("${paths.index_report}", {"cache": False}),
)


def corpus_passages(name: str, corpus, qa: pd.DataFrame):
    if corpus.source == OVOS:
        passages = ovos_passages()
    elif corpus.source == QA:
        passages = qa_fact_passages(qa)
    else:
        passages = jsonl_passages(corpus.source, corpus.id_field, corpus.title_field, corpus.text_field)
    return check_passages(passages, f"index_corpus.corpora.{name} ({corpus.source})")


def recall_at_k(
    retriever: BM25Retriever, questions: list[str], answers: list[list[str]], ks: list[int]
) -> dict[str, float]:
    """Share of questions with a reference answer in one of their top-k passages, for each k."""
    hits = retriever.batch_search(questions, max(ks))
    return {
        f"answer_recall@{k}": sum(
            answer_recall([h.passage.text for h in found[:k]], refs) for found, refs in zip(hits, answers)
        )
        / len(questions)
        for k in ks
    }


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "index_corpus")
    index = params["index_corpus"]
    qa = pd.read_parquet(params["paths.qa"])
    test = qa[qa["split"] == "test"]
    root = Path(params["paths.rag_index"])
    if root.exists():
        shutil.rmtree(root)
    report = {}
    for name, corpus in index.corpora.items():
        start = time.perf_counter()
        retriever = BM25Retriever.build(corpus_passages(name, corpus, qa), index.bm25)
        manifest = retriever.save(root / name)
        seconds = time.perf_counter() - start
        recall = recall_at_k(retriever, list(test["question"]), [list(a) for a in test["answers"]], index.recall_k)
        report[name] = {
            "source": corpus.source,
            "passages": manifest["passages"],
            "vocabulary": manifest["vocabulary"],
            "digest": manifest["digest"],
            "seconds": round(seconds, 2),
            "test_questions": len(test),
            **recall,
        }
        log.info(
            "%s: %d passages, vocabulary %d, %.1f s; %s",
            name,
            manifest["passages"],
            manifest["vocabulary"],
            seconds,
            recall,
        )
    write_json(params["paths.index_report"], report)


if __name__ == "__main__":
    run(main)
