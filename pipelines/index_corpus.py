"""Stage index_corpus: a bm25s index per passage corpus of ``index_corpus.corpora`` under ``paths.rag_index/<name>/``.

Each directory holds the passages (``passages.jsonl``), the index and ``manifest.json`` with the hashes of both
(``rag_eval`` records the digest with its results). Only the corpora whose passages or params changed are built again
(the manifest keeps the key they were built with); a build is streamed in chunks and resumes where a killed run
stopped (its work under ``paths.rag_index/.building/<name>/``). A directory there that is no corpus of
``index_corpus.corpora`` is removed, unless its manifest names another engine (an index served elsewhere, put there by
hand: :func:`detectors.rag.retriever.open_index`). Malformed or empty records of a JSONL corpus are
skipped and counted. ``paths.index_report`` gives per corpus the passages, skipped records, vocabulary, digest, build
time and whether it was built in this run, and the retriever's **answer recall@k**: how often one of the top k
passages for a QA test question (the question as the query) holds a reference answer. It tells a weak corpus from a
weak trigger.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pandas as pd

from detectors.evaluation.answer_metrics import answer_recall
from detectors.io import write_json
from detectors.rag.bm25_build import build_key
from detectors.rag.corpus import OVOS, QA, JsonlPassages, PassageList, PassageSource, ovos_passages, qa_fact_passages
from detectors.rag.retriever import BM25Retriever, IndexError_, Retriever, open_index, read_manifest
from pipelines._stage import run, stage_params

log = logging.getLogger("index_corpus")
READS = ("index_corpus", "paths.qa", "paths.rag_index", "paths.index_report")
DEPS = ("${paths.qa}",)
OUTS = (
    ("${paths.rag_index}", {"persist": True}, "kept between runs: only the corpora that changed are built again"),
    ("${paths.index_report}", {"cache": False}),
)
BUILDING = ".building"  # resumable work of the builds under way, removed when they finish


def corpus_source(name: str, corpus, qa: pd.DataFrame) -> PassageSource:
    """The passages of ``index_corpus.corpora.<name>``."""
    label = f"index_corpus.corpora.{name} ({corpus.source})"
    if corpus.source == OVOS:
        return PassageList(ovos_passages(), label)
    if corpus.source == QA:
        return PassageList(qa_fact_passages(qa), label)
    source = JsonlPassages(corpus.source, corpus.id_field, corpus.title_field, corpus.text_field)
    source.label = label
    return source


def recall_at_k(
    retriever: Retriever, questions: list[str], answers: list[list[str]], ks: list[int]
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


def _manifest(directory: Path) -> dict:
    try:
        return read_manifest(directory)
    except (IndexError_, ValueError):  # no manifest (an interrupted build), or a broken one
        return {}


def built_with(directory: Path) -> str | None:
    """The build key of the complete index in ``directory``, None when there is none."""
    return _manifest(directory).get("build", {}).get("key")


def engine(directory: Path) -> str | None:
    """The engine of the index in ``directory`` (None without a manifest)."""
    manifest = _manifest(directory)
    return manifest.get("engine", "bm25s") if manifest else None


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "index_corpus")
    index = params["index_corpus"]
    qa = pd.read_parquet(params["paths.qa"])
    test = qa[qa["split"] == "test"]
    root = Path(params["paths.rag_index"])
    root.mkdir(parents=True, exist_ok=True)
    for stale in sorted(p for p in root.iterdir() if p.name not in index.corpora and p.name != BUILDING):
        if engine(stale) not in (None, "bm25s"):  # an index of another engine, put there by hand: kept
            continue
        log.info("removing %s: not a corpus of index_corpus.corpora", stale)
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    for stale in sorted((root / BUILDING).glob("*")):
        if stale.name not in index.corpora:
            shutil.rmtree(stale)
    bm25 = dataclasses.asdict(index.bm25)
    report = {}
    for name, corpus in index.corpora.items():
        source = corpus_source(name, corpus, qa)
        built = built_with(root / name) != build_key(source, bm25)
        if built:
            BM25Retriever.build(source, bm25, root / name, root / BUILDING / name, desc=name)
        else:
            log.info("%s: unchanged since it was built, kept", name)
        retriever = open_index(root / name)  # the hashes checked, whether built now or kept
        manifest = retriever.manifest
        recall = recall_at_k(retriever, list(test["question"]), [list(a) for a in test["answers"]], index.recall_k)
        report[name] = {
            "source": corpus.source,
            "passages": manifest["passages"],
            "skipped": manifest["build"]["skipped"],
            "vocabulary": manifest["vocabulary"],
            "digest": manifest["digest"],
            "seconds": manifest["build"]["seconds"],
            "built": built,
            "test_questions": len(test),
            **recall,
        }
        log.info(
            "%s: %d passages (skipped %s), vocabulary %d, %s; %s",
            name,
            manifest["passages"],
            manifest["build"]["skipped"] or "none",
            manifest["vocabulary"],
            f"built in {manifest['build']['seconds']:.1f} s" if built else "kept",
            recall,
        )
    if (root / BUILDING).is_dir() and not any((root / BUILDING).iterdir()):
        (root / BUILDING).rmdir()
    write_json(params["paths.index_report"], report)


if __name__ == "__main__":
    run(main)
