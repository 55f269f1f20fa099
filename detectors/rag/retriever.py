"""What the RAG loop retrieves from: the :class:`Retriever` interface and a bm25s index over local passages.

The loop only calls ``search``/``batch_search``, so an Elasticsearch client or a dense index that returns
:class:`Hit` lists replaces :class:`BM25Retriever` without touching it. The index is built once (stage
``index_corpus``) into a directory whose ``manifest.json`` holds the hashes of the corpus and of every index file;
loading refuses files that do not match it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from detectors.errors import InputError
from detectors.io import changed_file, file_digests
from detectors.rag.corpus import Passage, read_passages, write_passages

MANIFEST = "manifest.json"
PASSAGES = "passages.jsonl"
INDEX = "bm25s"
DOCUMENT_FREQUENCY = "document_frequency.json"


def _bm25s():
    """bm25s, imported without JAX. Where JAX is installed, importing bm25s runs a JAX top-k, which starts JAX on the
    GPU and takes 75 % of its memory (on an H100: 60 of 80 GiB, and the LLM beside it ran out of memory). The retriever
    selects its top k itself, so bm25s needs no JAX: while bm25s is first imported, ``import jax`` fails and bm25s
    falls back to numpy; JAX stays importable, untouched, for the rest of the process. A JAX the process imported
    before is left as it is."""
    if "bm25s" not in sys.modules and "jax" not in sys.modules:
        sys.modules["jax"] = None  # `import jax` raises ImportError while bm25s is imported
        try:
            import bm25s
        finally:
            del sys.modules["jax"]
    import bm25s

    return bm25s


@dataclasses.dataclass(frozen=True)
class Hit:
    passage: Passage
    score: float
    rank: int  # 1-based


@runtime_checkable
class Retriever(Protocol):
    def search(self, query: str, k: int) -> list[Hit]:
        """The ``k`` best passages for ``query``, best first; [] when nothing matches."""
        ...

    def batch_search(self, queries: list[str], k: int) -> list[list[Hit]]: ...


class IndexError_(InputError):
    """An index directory that is missing, incomplete or does not match its manifest."""


class BM25Retriever:
    """BM25 (bm25s: ``method``, ``k1``, ``b``) over passages tokenised with bm25s's tokenizer, English stop words and
    the Snowball stemmer. Ties are broken by passage order, so a search is deterministic."""

    def __init__(
        self, passages: list[Passage], index, params: dict, document_frequency: dict[str, int], digest: str = ""
    ):
        self.passages, self.index, self.params, self.df, self.digest = (
            passages,
            index,
            dict(params),
            document_frequency,
            digest,
        )
        self._stemmer = _stemmer(self.params.get("stemmer"))

    # ---- building and storing ------------------------------------------------------------------------------
    @classmethod
    def build(cls, passages: list[Passage], params) -> BM25Retriever:
        """Index ``passages`` (``params``: a mapping or dataclass with method, k1, b, stopwords, stemmer)."""
        bm25s = _bm25s()

        params = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params)
        if not passages:
            raise InputError("cannot index an empty corpus: give at least one passage")
        tokens = bm25s.tokenize(
            [_indexed_text(p) for p in passages],
            stopwords=params["stopwords"],
            stemmer=_stemmer(params["stemmer"]),
            return_ids=False,
            show_progress=False,
        )
        index = bm25s.BM25(method=params["method"], k1=params["k1"], b=params["b"])
        # bm25s numbers its vocabulary in set order, which changes with PYTHONHASHSEED; sorted, the index files are
        # byte-identical on every run
        vocab = {term: i for i, term in enumerate(sorted({t for doc in tokens for t in doc}))}
        if not vocab:
            raise InputError("the corpus has no indexable word (only stop words or punctuation): check its text field")
        index.index(([[vocab[t] for t in doc] for doc in tokens], vocab), create_empty_token=False, show_progress=False)
        df: dict[str, int] = {}
        for doc in tokens:
            for term in set(doc):
                df[term] = df.get(term, 0) + 1
        return cls(passages, index, params, df)

    def save(self, directory: str | Path) -> dict:
        """Write passages, index and manifest; returns the manifest (counts, params, hashes, ``digest``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_passages(self.passages, directory / PASSAGES)
        self.index.save(str(directory / INDEX))
        (directory / DOCUMENT_FREQUENCY).write_text(json.dumps(self.df, sort_keys=True))
        files = file_digests(
            directory,
            [str(p.relative_to(directory)) for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST],
        )
        self.digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
        manifest = {
            "passages": len(self.passages),
            "vocabulary": len(self.df),
            "params": self.params,
            "files": files,
            "digest": self.digest,
        }
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return manifest

    @classmethod
    def load(cls, directory: str | Path) -> BM25Retriever:
        """The index saved in ``directory``; refuses a missing directory or files that do not match the manifest."""
        bm25s = _bm25s()

        directory = Path(directory)
        if not (directory / MANIFEST).is_file():
            raise IndexError_(f"no bm25s index in {str(directory)!r} (no {MANIFEST}): run `dvc repro index_corpus`")
        manifest = json.loads((directory / MANIFEST).read_text())
        problem = changed_file(directory, manifest["files"])
        if problem is not None:
            raise IndexError_(f"{problem}: rerun `dvc repro index_corpus` to rebuild the index")
        index = bm25s.BM25.load(str(directory / INDEX))
        df = json.loads((directory / DOCUMENT_FREQUENCY).read_text())
        return cls(read_passages(directory / PASSAGES), index, manifest["params"], df, manifest["digest"])

    # ---- searching -----------------------------------------------------------------------------------------
    def terms(self, text: str) -> list[str]:
        """The index's terms of ``text`` (lower-cased, stop words dropped, stemmed)."""
        bm25s = _bm25s()

        return bm25s.tokenize(
            [text], stopwords=self.params["stopwords"], stemmer=self._stemmer, return_ids=False, show_progress=False
        )[0]

    def search(self, query: str, k: int) -> list[Hit]:
        terms = [t for t in self.terms(query) if t in self.df]
        if not terms or k <= 0:
            return []
        scores = np.asarray(self.index.get_scores(terms), dtype=np.float64)
        order = np.lexsort((np.arange(len(scores)), -scores))[:k]
        return [Hit(self.passages[i], float(scores[i]), r + 1) for r, i in enumerate(order) if scores[i] > 0]

    def batch_search(self, queries: list[str], k: int) -> list[list[Hit]]:
        return [self.search(q, k) for q in queries]

    def idf(self, term: str) -> float:
        """BM25's idf of a word (as the index sees it: lower-cased and stemmed); 0 for a stop word or unknown term."""
        terms = self.terms(term)
        if not terms or terms[0] not in self.df:
            return 0.0
        n, df = len(self.passages), self.df[terms[0]]
        return math.log(1 + (n - df + 0.5) / (df + 0.5))


def _indexed_text(p: Passage) -> str:
    return f"{p.title}\n{p.text}" if p.title else p.text


def _stemmer(name: str | None):
    if not name:
        return None
    import Stemmer

    return Stemmer.Stemmer(name)
