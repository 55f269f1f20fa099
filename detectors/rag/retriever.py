"""What the RAG loop retrieves from: the :class:`Retriever` interface, :func:`open_index` and a bm25s index over local
passages (:class:`BM25Retriever`).

The loop only calls ``search``/``batch_search`` (and reads ``digest``), so another engine that returns :class:`Hit`
lists replaces :class:`BM25Retriever` without touching it: the stages open every index with :func:`open_index`, which
reads the directory's ``manifest.json`` and hands it to the class :data:`ENGINES` registers under its ``engine``
(``bm25s`` here; an Elasticsearch or Lucene index would be a manifest naming its engine, server and index, and one
module). A query formulation that weighs words by the index's term statistics (DioR's idf) needs a retriever that is
also :class:`TermStatistics`.

The bm25s index is built once (stage ``index_corpus``, streaming: :mod:`detectors.rag.bm25_build`) into a directory
whose manifest holds the hashes of the corpus and of every index file; loading refuses files that do not match it,
then maps the index into memory and reads passages from the passages file by offset, so a 21M-passage index loads in
seconds and holds little memory of its own. A search ranks only the passages its terms reach
(:mod:`detectors.rag.bm25_search`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from detectors.errors import InputError
from detectors.io import changed_file
from detectors.lazy import LazyRegistry
from detectors.rag.bm25_build import (
    CHUNK,
    INDEX,
    MANIFEST,
    PASSAGE_OFFSETS,
    PASSAGES,
    VOCABULARY,
    VOCABULARY_OFFSETS,
    build_index,
    import_bm25s,
    stemmer,
)
from detectors.rag.corpus import Passage, PassageFile, PassageList, PassageSource

TERMS_REMEMBERED = 100_000  # query terms whose ids a retriever keeps (a dict, cleared when full)


@dataclasses.dataclass(frozen=True)
class Hit:
    passage: Passage
    score: float
    rank: int  # 1-based


@runtime_checkable
class Retriever(Protocol):
    digest: str  # the index's identity, recorded with every result that used it

    def search(self, query: str, k: int) -> list[Hit]:
        """The ``k`` best passages for ``query``, best first; [] when nothing matches."""
        ...

    def batch_search(self, queries: list[str], k: int) -> list[list[Hit]]: ...


@runtime_checkable
class TermStatistics(Protocol):
    """A retriever that knows its corpus's term statistics (what DioR's query weighs keywords by)."""

    def idf(self, term: str) -> float:
        """BM25's idf of a word as the index sees it; 0 for a word it does not hold."""
        ...


class IndexError_(InputError):
    """An index directory that is missing, incomplete or does not match its manifest."""


# engine name (a manifest's "engine") -> the class that opens such an index: ``open(directory, manifest)``
ENGINES = LazyRegistry("retrieval engine", {"bm25s": "detectors.rag.retriever:BM25Retriever"}, IndexError_)


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise IndexError_(f"no index in {str(directory)!r} (no {MANIFEST}): run `dvc repro index_corpus`")
    return json.loads(path.read_text())


def open_index(directory: str | Path) -> Retriever:
    """The index in ``directory``, opened by the engine its manifest names (bm25s when it names none)."""
    manifest = read_manifest(directory)
    return ENGINES.load(manifest.get("engine", "bm25s")).open(directory, manifest)


def _mapped(path: Path) -> np.ndarray:
    """A ``.npy`` file memory-mapped read-only, as a plain array (np.memmap's own indexing is slow)."""
    return np.load(path, mmap_mode="r").view(np.ndarray)


class BM25Retriever:
    """BM25 (bm25s: ``method``, ``k1``, ``b``) over passages tokenised with bm25s's tokenizer, English stop words and
    the Snowball stemmer. Ties are broken by passage order, so a search is deterministic. ``threads``: how many
    queries of a batch are scored at once (default: the CPUs the process may use)."""

    def __init__(self, directory: str | Path, manifest: dict, threads: int | None = None, owner=None):
        from detectors.io import cpu_threads
        from detectors.rag.bm25_search import Searcher

        self.directory, self.manifest, self._owner = Path(directory), manifest, owner  # owner: a temporary dir
        self.params, self.digest = dict(manifest["params"]), manifest["digest"]
        self._stemmer = stemmer(self.params.get("stemmer"))
        folder = self.directory / INDEX
        nonoccurrence = folder / "nonoccurrence_array.index.npy"
        self._nonoccurrence = np.load(nonoccurrence) if nonoccurrence.is_file() else None
        self.passages = PassageFile(self.directory / PASSAGES, _mapped(self.directory / PASSAGE_OFFSETS))
        self._searcher = Searcher(
            _mapped(folder / "data.csc.index.npy"),
            _mapped(folder / "indices.csc.index.npy"),
            _mapped(folder / "indptr.csc.index.npy"),
            len(self.passages),
            threads or cpu_threads(),
        )
        with open(self.directory / VOCABULARY, "rb") as f:
            self._vocabulary = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._term_offsets = _mapped(self.directory / VOCABULARY_OFFSETS)
        self._term_ids: dict[str, int | None] = {}

    @property
    def threads(self) -> int:
        return self._searcher.threads

    @threads.setter
    def threads(self, n: int) -> None:
        self._searcher.threads = n

    # ---- building, storing, opening -----------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        passages: Iterable[Passage] | PassageSource,
        params,
        directory: str | Path | None = None,
        work: str | Path | None = None,
        chunk: int = CHUNK,
        desc: str | None = None,
    ) -> BM25Retriever:
        """Index ``passages`` (a list, or a :class:`~detectors.rag.corpus.PassageSource` read as a stream;
        ``params``: a mapping or dataclass with method, k1, b, stopwords, stemmer) into ``directory`` (a temporary
        one by default, removed with the retriever), resuming an interrupted build there
        (:func:`~detectors.rag.bm25_build.build_index`); ``desc`` names the progress bars (none without)."""
        params = dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params)
        source = passages if hasattr(passages, "read") else PassageList(list(passages))
        owner = None
        if directory is None:
            owner = tempfile.TemporaryDirectory(prefix="bm25s-")
            directory, work = Path(owner.name) / "index", Path(owner.name) / "work"
        manifest = build_index(source, params, directory, work, chunk, desc)
        return cls(directory, manifest, owner=owner)

    def save(self, directory: str | Path) -> dict:
        """Copy the index into ``directory``; returns its manifest (counts, params, hashes, ``digest``)."""
        directory = Path(directory)
        if directory.resolve() != self.directory.resolve():
            for name in [*self.manifest["files"], *self.manifest["derived"], MANIFEST]:
                (directory / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.directory / name, directory / name)
        return dict(self.manifest)

    @classmethod
    def load(cls, directory: str | Path) -> BM25Retriever:
        """The bm25s index saved in ``directory`` (:meth:`open` with its manifest)."""
        return cls.open(directory, read_manifest(directory))

    @classmethod
    def open(cls, directory: str | Path, manifest: dict) -> BM25Retriever:
        """The index in ``directory`` described by ``manifest``; refuses files that do not match the manifest's
        hashes (each file read as a stream, several at once) and an index built before the derived files existed."""
        directory = Path(directory)
        if "derived" not in manifest:
            raise IndexError_(
                f"the index in {str(directory)!r} was built by an earlier version (it lacks {PASSAGE_OFFSETS}): "
                "rerun `dvc repro index_corpus`"
            )
        problem = changed_file(directory, {**manifest["files"], **manifest["derived"]})
        if problem is not None:
            raise IndexError_(f"{problem}: rerun `dvc repro index_corpus` to rebuild the index")
        return cls(directory, manifest)

    # ---- searching -----------------------------------------------------------------------------------------
    def terms(self, text: str) -> list[str]:
        """The index's terms of ``text`` (lower-cased, stop words dropped, stemmed)."""
        return self._terms([text])[0]

    def _terms(self, texts: list[str]) -> list[list[str]]:
        bm25s = import_bm25s()  # without JAX

        return bm25s.tokenize(
            texts, stopwords=self.params["stopwords"], stemmer=self._stemmer, return_ids=False, show_progress=False
        )

    def term_id(self, term: str) -> int | None:
        """The id of an index term (its rank in the sorted vocabulary), None for a term the index does not hold: a
        binary search over the memory-mapped vocabulary (UTF-8 orders bytes as Python orders strings), remembered."""
        found = self._term_ids.get(term, -1)
        if found == -1:
            found = self._find_term(term)
            if len(self._term_ids) >= TERMS_REMEMBERED:
                self._term_ids.clear()
            self._term_ids[term] = found
        return found

    def _find_term(self, term: str) -> int | None:
        key, offsets, words = term.encode("utf-8"), self._term_offsets, self._vocabulary
        lo, hi = 0, len(offsets) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if words[offsets[mid] : offsets[mid + 1] - 1] < key:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(offsets) - 1 and words[offsets[lo] : offsets[lo + 1] - 1] == key:
            return lo
        return None

    def search(self, query: str, k: int) -> list[Hit]:
        return self.batch_search([query], k)[0]

    def batch_search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Each query's hits; the queries are scored on :attr:`threads` threads at once."""
        if k <= 0 or not queries:
            return [[] for _ in queries]
        plans = []
        for terms in self._terms(list(queries)):
            ids = [i for i in map(self.term_id, terms) if i is not None]
            constant = 0.0
            if ids and self._nonoccurrence is not None:  # as bm25s adds it to every passage's score
                constant = self._nonoccurrence[np.asarray(ids, dtype=np.int32)].sum()
            plans.append((np.asarray(ids, dtype=np.int64), constant))
        asked = [i for i, (ids, _) in enumerate(plans) if len(ids)]
        found = dict(zip(asked, self._searcher.many([plans[i] for i in asked], k)))
        out: list[list[Hit]] = []
        for i in range(len(plans)):
            docs, scores = found.get(i, ((), ()))
            out.append(
                [Hit(self.passages[int(d)], float(s), r + 1) for r, (d, s) in enumerate(zip(docs, scores)) if s > 0]
            )
        return out

    def idf(self, term: str) -> float:
        """BM25's idf of a word (as the index sees it: lower-cased and stemmed); 0 for a stop word or unknown term."""
        terms = self.terms(term)
        t = self.term_id(terms[0]) if terms else None
        if t is None:
            return 0.0
        indptr = self._searcher.indptr
        n, df = len(self.passages), int(indptr[t + 1] - indptr[t])
        return math.log(1 + (n - df + 0.5) / (df + 0.5))
