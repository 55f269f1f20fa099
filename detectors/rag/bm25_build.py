"""The streaming build of a bm25s index: a corpus of any size in bounded memory, resumable after a crash.

The files are byte-identical to what ``bm25s.BM25.index`` writes for the whole corpus at once (its scoring functions
compute every value), but the corpus is never held: three passes over chunks of :data:`CHUNK` passages.

1. **Tokenize** (resumable): each chunk's passages are appended to ``passages.jsonl`` and tokenized with bm25s's
   tokenizer; the chunk's (passage, term, count) entries, its passages' lengths, byte offsets and id hashes, and its
   own vocabulary go to a chunk file in the work directory, and ``state.json`` records how far the source was read.
   A rerun after a crash truncates ``passages.jsonl`` to the last finished chunk and reads the source on from there.
2. **Vocabulary**: the chunks' vocabularies merged and sorted (the term ids are ranks, so the files do not depend on
   ``PYTHONHASHSEED``), document frequencies summed, idf computed as bm25s computes it.
3. **Postings**: the CSC arrays (``data``: the float32 score of each (term, passage) pair; ``indices``: the passage;
   ``indptr``: where each term's postings start) written in place into memory-mapped ``.npy`` files, chunk by chunk,
   each chunk's entries scattered to their term's next free slots.

Memory: one chunk's tokens, the vocabulary (a dict of the corpus's terms) and 8 bytes a passage for the id check; the
index arrays are written through the page cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from detectors.errors import InputError, SourceError
from detectors.io import file_digests, write_json
from detectors.progress import progress
from detectors.rag.corpus import Passage, PassageSource, Skipped, passage_line

log = logging.getLogger(__name__)

CHUNK = 50_000  # passages a chunk: ~150 MB of tokens in flight, ~2 s of tokenizing
FORMAT = 2  # the build's own version: an index built by another is rebuilt (part of the build key)

MANIFEST = "manifest.json"
PASSAGES = "passages.jsonl"
INDEX = "bm25s"
DOCUMENT_FREQUENCY = "document_frequency.json"
# files derived from the ones above, for memory-mapped loading; hashed in the manifest, outside the index's digest
PASSAGE_OFFSETS = "passages.offsets.npy"
VOCABULARY = "vocabulary.txt"  # the sorted terms, one a line (term id = line number)
VOCABULARY_OFFSETS = "vocabulary.offsets.npy"
DERIVED = (PASSAGE_OFFSETS, VOCABULARY, VOCABULARY_OFFSETS)
STATE = "state.json"


def import_bm25s():
    """bm25s, imported without JAX. Where JAX is installed, importing bm25s runs a JAX top-k, which starts JAX on the
    GPU and takes 75 % of its memory (on an H100: 60 of 80 GiB, and the LLM beside it ran out of memory). The retriever
    selects its top k itself, so bm25s needs no JAX: while bm25s is first imported, ``import jax`` fails and bm25s
    falls back to numpy; JAX stays importable, untouched, for the rest of the process. A JAX the process imported
    before is left as it is."""
    import sys

    if "bm25s" not in sys.modules and "jax" not in sys.modules:
        sys.modules["jax"] = None  # `import jax` raises ImportError while bm25s is imported
        try:
            import bm25s
        finally:
            del sys.modules["jax"]
    import bm25s

    return bm25s


def stemmer(name: str | None):
    if not name:
        return None
    import Stemmer

    return Stemmer.Stemmer(name)


def indexed_text(p: Passage) -> str:
    return f"{p.title}\n{p.text}" if p.title else p.text


def tokenize(texts: list[str], params: dict, stem=None) -> tuple[list[list[int]], dict[str, int]]:
    """bm25s's tokens of ``texts`` (lower-cased, stop words dropped, stemmed): per text its term ids, and the ids."""
    bm25s = import_bm25s()
    stem = stem if stem is not None else stemmer(params["stemmer"])
    ids, vocab = bm25s.tokenize(
        texts, stopwords=params["stopwords"], stemmer=stem, return_ids=True, show_progress=False
    )
    return ids, vocab


def build_key(source: PassageSource, params: dict) -> str:
    """What an index is a function of: the source's passages, the BM25 params, this build and the tokenizer's
    versions. An index (or an interrupted build) with the same key is reused."""
    from importlib.metadata import version

    parts = {
        "source": source.fingerprint(),
        "params": params,
        "format": FORMAT,
        "bm25s": version("bm25s"),
        "PyStemmer": version("PyStemmer"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class _State:
    """How far phase 1 got: chunks written, the source's position after them, what they hold."""

    key: str
    chunks: int = 0
    position: tuple[int, int] = (0, 0)
    passages: int = 0
    bytes: int = 0
    tokens: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    examples: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def resume(cls, work: Path, directory: Path, key: str) -> _State | None:
        path, passages = work / STATE, directory / PASSAGES
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        if state.get("key") != key or not passages.is_file() or passages.stat().st_size < state["bytes"]:
            return None
        state["position"] = tuple(state["position"])
        return cls(**state)

    def save(self, work: Path) -> None:
        write_json(work / STATE, dataclasses.asdict(self))


def build_index(
    source: PassageSource,
    params: dict,
    directory: str | Path,
    work: str | Path | None = None,
    chunk: int = CHUNK,
    desc: str | None = None,
) -> dict:
    """Index ``source`` into ``directory`` (``params``: method, k1, b, stopwords, stemmer); returns the manifest.
    ``work`` holds the resumable work (default: ``<directory>.work``), removed when the index is complete: a rerun
    with the same source and params after a crash goes on from the last finished chunk. ``desc`` names the progress
    bars and log lines (none without)."""
    if chunk < 1:
        raise InputError(f"chunk = {chunk}: a chunk holds at least one passage")
    start = time.perf_counter()
    directory = Path(directory)
    work = Path(work) if work is not None else directory.with_name(directory.name + ".work")
    key = build_key(source, params)
    state = _State.resume(work, directory, key)
    if state is None:
        for path in (work, directory):
            if path.exists():
                shutil.rmtree(path)
        work.mkdir(parents=True)
        directory.mkdir(parents=True)
        (directory / PASSAGES).write_bytes(b"")
        state = _State(key)
    else:
        log.info("%s: resuming after %d passages (%d chunks done)", desc or directory, state.passages, state.chunks)
        for path in directory.iterdir():  # what the crashed run wrote after its passages is written again
            if path.name != PASSAGES:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    _tokenize_chunks(source, params, directory, work, state, chunk, desc)
    if not state.passages:
        raise SourceError(f"{source.label}: the corpus holds no passage{_skipped_summary(state)}")
    if state.skipped:
        log.warning("%s: %s", desc or directory, _skipped_summary(state).lstrip("; "))
    chunks = [work / f"chunk-{c:05d}.npz" for c in range(state.chunks)]
    offsets = _passage_offsets(chunks, directory, state)
    _check_unique_ids(chunks, directory, offsets, source.label)
    terms, ids, df = _vocabulary(chunks)
    if not terms:
        raise InputError("the corpus has no indexable word (only stop words or punctuation): check its text field")
    if desc:
        log.info("%s: %d passages, %d terms; writing the postings", desc, state.passages, len(terms))
    _write_vocabulary(directory, terms, df)
    _write_postings(chunks, params, directory, ids, df, state, desc)
    del ids
    if desc:
        log.info("%s: hashing the files", desc)
    manifest = {
        "passages": state.passages,
        "vocabulary": len(terms),
        "params": params,
        **_hashes(directory),
        "engine": "bm25s",
        "build": {
            "key": key,
            "skipped": state.skipped,
            "skipped_examples": state.examples,
            "seconds": round(time.perf_counter() - start, 2),
        },
    }
    part = directory / (MANIFEST + ".part")
    part.write_text(json.dumps(manifest, indent=2))
    os.replace(part, directory / MANIFEST)  # the index is complete once its manifest is there
    shutil.rmtree(work)
    return manifest


def _skipped_summary(state: _State) -> str:
    if not state.skipped:
        return ""
    counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(state.skipped.items()))
    first = next(iter(state.examples.values()))  # the reasons in the order they were first met
    return f"; records skipped ({counts}), the first: {first}"


# ---- phase 1: tokenize, chunk by chunk -------------------------------------------------------------------------
def _tokenize_chunks(
    source: PassageSource, params: dict, directory: Path, work: Path, state: _State, chunk: int, desc: str
) -> None:
    stem = stemmer(params["stemmer"])
    records = source.read(state.position)
    with (
        open(directory / PASSAGES, "r+b") as out,
        progress(
            total=source.size(), initial=state.position[0], desc=f"{desc}: tokenize", unit=source.unit, disable=not desc
        ) as bar,
    ):
        out.truncate(state.bytes)
        out.seek(state.bytes)
        while True:
            before = state.position[0]
            passages, position = _next_chunk(records, chunk, state)
            if passages:
                _write_chunk(passages, params, stem, out, work / f"chunk-{state.chunks:05d}.npz", state)
                state.position = position
                state.save(work)
            bar.update(position[0] - before)
            if not passages:
                return


def _write_chunk(passages: list[Passage], params: dict, stem, out, path: Path, state: _State) -> None:
    """Append ``passages`` to ``passages.jsonl`` (``out``) and write their chunk file; ``state`` counts them."""
    lines = [passage_line(p) for p in passages]
    sizes = np.fromiter(map(len, lines), np.int64, count=len(lines))
    out.write(b"".join(lines))
    out.flush()
    tokens, vocab = tokenize([indexed_text(p) for p in passages], params, stem)
    entries = _entries(tokens, len(vocab))
    terms = [""] * len(vocab)
    for term, i in vocab.items():
        terms[i] = term
    with open(path.with_suffix(".part"), "wb") as f:
        np.savez(
            f,
            starts=state.bytes + np.concatenate([[0], np.cumsum(sizes)[:-1]]),
            id_hash=np.fromiter((_id_hash(p.id) for p in passages), np.uint64, count=len(passages)),
            **entries,
            vocab=np.frombuffer("\n".join(terms).encode("utf-8"), np.uint8),
        )
    os.replace(path.with_suffix(".part"), path)
    state.chunks, state.passages, state.bytes = (
        state.chunks + 1,
        state.passages + len(passages),
        state.bytes + int(sizes.sum()),
    )
    state.tokens += int(entries["lengths"].sum())


def _next_chunk(
    records: Iterator[tuple[tuple[int, int], Passage | Skipped]], chunk: int, state: _State
) -> tuple[list[Passage], tuple[int, int]]:
    """Up to ``chunk`` passages from ``records``, and the position after the last one; skipped records are counted
    into ``state`` (a crash before the chunk is saved counts them again from the saved state: they are recounted)."""
    passages, position = [], state.position
    skipped, examples = Counter(), {}
    for after, record in records:
        position = after
        if isinstance(record, Skipped):
            skipped[record.reason] += 1
            examples.setdefault(record.reason, record.detail)
            continue
        passages.append(record)
        if len(passages) == chunk:
            break
    for reason, n in skipped.items():
        state.skipped[reason] = state.skipped.get(reason, 0) + n
        state.examples.setdefault(reason, examples[reason])
    return passages, position


def _entries(tokens: list[list[int]], n_terms: int) -> dict[str, np.ndarray]:
    """A chunk's (passage, term, count) entries, by passage then term, its passages' lengths and its terms' document
    frequencies."""
    lengths = np.fromiter(map(len, tokens), np.int64, count=len(tokens))
    flat = np.fromiter(itertools.chain.from_iterable(tokens), np.int64, count=int(lengths.sum()))
    doc = np.repeat(np.arange(len(tokens), dtype=np.int64), lengths)
    pairs, tf = np.unique(doc * max(n_terms, 1) + flat, return_counts=True)
    term = (pairs % max(n_terms, 1)).astype(np.int32)
    return {
        "lengths": lengths.astype(np.int32),
        "doc": (pairs // max(n_terms, 1)).astype(np.int32),
        "term": term,
        "tf": tf.astype(np.int32),
        "df": np.bincount(term, minlength=n_terms).astype(np.int64),
    }


def _id_hash(pid: str) -> int:
    return int.from_bytes(hashlib.blake2b(pid.encode("utf-8"), digest_size=8).digest(), "little")


def _chunk_vocabulary(chunk: np.lib.npyio.NpzFile) -> list[str]:
    blob = chunk["vocab"].tobytes().decode("utf-8")
    return blob.split("\n") if len(chunk["df"]) else []


# ---- after phase 1: offsets, unique ids ------------------------------------------------------------------------
def _passage_offsets(chunks: list[Path], directory: Path, state: _State) -> np.ndarray:
    offsets = np.lib.format.open_memmap(
        directory / PASSAGE_OFFSETS, mode="w+", dtype=np.int64, shape=(state.passages + 1,)
    )
    at = 0
    for path in chunks:
        starts = np.load(path)["starts"]
        offsets[at : at + len(starts)] = starts
        at += len(starts)
    offsets[at] = state.bytes
    offsets.flush()
    return offsets


def _check_unique_ids(chunks: list[Path], directory: Path, offsets: np.ndarray, label: str) -> None:
    """Refuse a duplicate passage id (naming it): ids are compared by a 64-bit hash, the equal hashes by the ids."""
    hashes = np.concatenate([np.load(path)["id_hash"] for path in chunks])
    order = np.argsort(hashes, kind="stable")
    same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
    if not len(same):
        return
    with open(directory / PASSAGES, "rb") as f:

        def pid(i: int) -> str:
            f.seek(int(offsets[i]))
            return json.loads(f.readline())["id"]

        for s in same:
            if pid(order[s]) == pid(order[s + 1]):
                raise SourceError(
                    f"{label}: passage id {pid(order[s])!r} occurs twice: ids must be unique (set id_field, or null "
                    f"for line numbers)"
                )


# ---- phase 2: the vocabulary -----------------------------------------------------------------------------------
def _vocabulary(chunks: list[Path]) -> tuple[list[str], dict[str, int], np.ndarray]:
    """The corpus's terms sorted, their ids (ranks) and document frequencies."""
    every: set[str] = set()
    for path in chunks:
        every.update(_chunk_vocabulary(np.load(path)))
    terms = sorted(every)
    del every
    ids = {term: i for i, term in enumerate(terms)}
    df = np.zeros(len(terms), dtype=np.int64)
    for path in chunks:
        chunk = np.load(path)
        local = _chunk_vocabulary(chunk)
        df[np.fromiter((ids[t] for t in local), np.int64, count=len(local))] += chunk["df"]
    return terms, ids, df


def _json_in_parts(dumps, items: Iterable[tuple[str, int]], part: int = 100_000) -> Iterator[str]:
    """``dumps(dict(items))`` written out in pieces of ``part`` items (the same text, never the whole dict)."""
    one, other = dumps({"a": 0}), dumps({"b": 1})
    both = dumps({"a": 0, "b": 1})
    separator = both[len(one) - 1 : len(both) - len(other) + 1]
    yield "{"
    items = iter(items)
    first = True
    while piece := dict(itertools.islice(items, part)):
        yield ("" if first else separator) + dumps(piece)[1:-1]
        first = False
    yield "}"


def _write_vocabulary(directory: Path, terms: list[str], df: np.ndarray) -> None:
    """bm25s's ``vocab.index.json`` (term -> id, in id order), the ``document_frequency.json`` of earlier versions
    (term -> document frequency, sorted) and the derived sorted term list with its line offsets."""
    bm25s = import_bm25s()
    (directory / INDEX).mkdir(exist_ok=True)
    with open(directory / INDEX / "vocab.index.json", "w", encoding="utf-8") as f:
        dumps = bm25s.utils.json_functions.dumps
        f.writelines(_json_in_parts(lambda d: dumps(d, ensure_ascii=False), zip(terms, itertools.count())))
    with open(directory / DOCUMENT_FREQUENCY, "w", encoding="utf-8") as f:
        f.writelines(_json_in_parts(lambda d: json.dumps(d, sort_keys=True), zip(terms, df.tolist())))
    sizes = np.zeros(len(terms) + 1, dtype=np.int64)
    with open(directory / VOCABULARY, "wb") as f:
        for i in range(0, len(terms), 100_000):
            lines = [(t + "\n").encode("utf-8") for t in terms[i : i + 100_000]]
            sizes[i + 1 : i + 1 + len(lines)] = np.fromiter(map(len, lines), np.int64, count=len(lines))
            f.write(b"".join(lines))
    np.save(directory / VOCABULARY_OFFSETS, np.cumsum(sizes))


# ---- phase 3: the postings -------------------------------------------------------------------------------------
def _write_postings(
    chunks: list[Path], params: dict, directory: Path, ids: dict[str, int], df: np.ndarray, state: _State, desc: str
) -> None:
    """The CSC arrays, written as ``bm25s.BM25.index`` + ``save`` write them: float32 scores computed by bm25s's own
    functions on the same float64/float32 operands, sorted by term, then passage."""
    bm25s = import_bm25s()
    from bm25s import scoring

    model = bm25s.BM25(method=params["method"], k1=params["k1"], b=params["b"])
    n_docs = state.passages
    avg_doc_len = np.float64(state.tokens) / n_docs  # = np.mean of the lengths: their sum is exact in float64
    frequencies = dict(enumerate(df.tolist()))
    idf = scoring._build_idf_array(frequencies, n_docs, scoring._select_idf_scorer(model.idf_method), model.dtype)
    nonoccurrence = None
    if model.method in model.methods_requiring_nonoccurrence:
        nonoccurrence = scoring._build_nonoccurrence_array(
            frequencies,
            n_docs,
            scoring._select_idf_scorer(model.idf_method),
            scoring._select_tfc_scorer(model.method),
            avg_doc_len,
            avg_doc_len,
            model.k1,
            model.b,
            model.delta,
            model.dtype,
        )
    del frequencies
    tfc = scoring._select_tfc_scorer(model.method)
    indptr = np.zeros(len(df) + 1, dtype=np.int64)
    np.cumsum(df, out=indptr[1:])
    nnz = int(indptr[-1])
    folder = directory / INDEX
    for name, dtype in (("data", model.dtype), ("indices", model.int_dtype)):  # the files, at their full size
        np.lib.format.open_memmap(folder / f"{name}.csc.index.npy", mode="w+", dtype=dtype, shape=(nnz,)).flush()
    heads = indptr[:-1].copy()
    first_doc = 0
    for path in progress(chunks, desc=f"{desc}: postings", unit="chunk", disable=not desc):
        chunk = np.load(path)
        local = _chunk_vocabulary(chunk)
        to_global = np.fromiter((ids[t] for t in local), np.int64, count=len(local))
        term = to_global[chunk["term"]]
        doc = chunk["doc"].astype(np.int64)
        lengths = chunk["lengths"].astype(np.int64)
        # the arithmetic of bm25s's _build_scores_and_indices_for_matrix, a passage's length as an array
        scores = idf[term] * tfc(
            tf_array=chunk["tf"].astype(model.dtype),
            l_d=lengths[doc],
            l_avg=avg_doc_len,
            k1=model.k1,
            b=model.b,
            delta=model.delta,
        )
        if nonoccurrence is not None:
            scores -= nonoccurrence[term]
        order = np.argsort(term, kind="stable")  # by term, then passage (entries come by passage)
        term = term[order]
        starts = np.flatnonzero(np.r_[True, term[1:] != term[:-1]])
        counts = np.diff(np.r_[starts, len(term)])
        rank = np.arange(len(term)) - np.repeat(starts, counts)
        where = heads[term] + rank
        for name, values in (("data", scores[order]), ("indices", doc[order] + first_doc)):
            # mapped for one chunk: its pages leave the process's memory when unmapped (the page cache has them)
            array = np.load(folder / f"{name}.csc.index.npy", mmap_mode="r+")
            array[where] = values
            array.flush()
            del array
        heads[term[starts]] += counts
        first_doc += len(lengths)
    np.save(folder / "indptr.csc.index.npy", indptr)
    if nonoccurrence is not None:
        np.save(folder / "nonoccurrence_array.index.npy", nonoccurrence)
    index_params = dict(
        k1=model.k1,
        b=model.b,
        delta=model.delta,
        method=model.method,
        idf_method=model.idf_method,
        dtype=model.dtype,
        int_dtype=model.int_dtype,
        num_docs=n_docs,
        version=bm25s.__version__,
        backend=model.backend,
    )
    with open(folder / "params.index.json", "w") as f:
        json.dump(index_params, f, indent=4)


# ---- the manifest's hashes ------------------------------------------------------------------------------------
def _hashes(directory: Path) -> dict:
    """``files`` (the index's own files, as earlier versions listed them), ``digest`` (the index's identity: a hash of
    those hashes) and ``derived`` (the lookup files derived from them)."""
    names = [
        str(p.relative_to(directory))
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST and p.name not in DERIVED
    ]
    files = file_digests(directory, names)
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    return {"files": files, "digest": digest, "derived": file_digests(directory, list(DERIVED))}
