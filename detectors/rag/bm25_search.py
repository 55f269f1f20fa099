"""Top-k BM25 search over a bm25s CSC index, compiled with numba, a batch in parallel threads.

A query's scores are summed into a dense float32 accumulator, term by term in the query's order and posting by posting
(the float32 sums of ``bm25s.BM25.get_scores``); one pass over the accumulator then keeps the best k in a heap: score
descending, then passage order, as a full sort would, without sorting (a passage enters only if it beats the heap's
worst, one comparison each). Each thread owns one accumulator, kept between queries. The kernel releases the GIL:
``batch_search`` runs a batch's queries on as many threads as the process may use (its CPU affinity).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

PARALLEL_MIN_PASSAGES = 100_000  # a smaller corpus is searched on one thread (a query takes ~0.1 ms there)


@numba.njit(inline="always")
def _worse(score_a, doc_a, score_b, doc_b) -> bool:
    """Whether (score_a, doc_a) ranks below (score_b, doc_b): a lower score, or the same score and a later passage."""
    return score_a < score_b or (score_a == score_b and doc_a > doc_b)


@numba.njit(inline="always")
def _sift_down(scores, docs, size, i) -> None:
    while True:
        worst, left, right = i, 2 * i + 1, 2 * i + 2
        if left < size and _worse(scores[left], docs[left], scores[worst], docs[worst]):
            worst = left
        if right < size and _worse(scores[right], docs[right], scores[worst], docs[worst]):
            worst = right
        if worst == i:
            return
        scores[i], scores[worst] = scores[worst], scores[i]
        docs[i], docs[worst] = docs[worst], docs[i]
        i = worst


@numba.njit(inline="always")
def _offer(scores, docs, size, k, score, doc) -> int:
    """Keep (score, doc) in the heap of the best ``k`` (its root the worst of them); returns the heap's size."""
    if size < k:
        i = size
        scores[i], docs[i] = score, doc
        while i > 0:
            parent = (i - 1) // 2
            if not _worse(scores[i], docs[i], scores[parent], docs[parent]):
                break
            scores[i], scores[parent] = scores[parent], scores[i]
            docs[i], docs[parent] = docs[parent], docs[i]
            i = parent
        return size + 1
    if _worse(scores[0], docs[0], score, doc):
        scores[0], docs[0] = score, doc
        _sift_down(scores, docs, size, 0)
    return size


@numba.njit(nogil=True, cache=True)
def top_k(data, indices, indptr, terms, k, constant, acc):
    """The best ``k`` passages for the query ``terms`` (term ids, repeats counted) with a positive score: their ids
    and float32 scores, best first. A passage's score is its postings' data summed in float32, term by term in the
    query's order, plus ``constant`` (bm25l/bm25+'s non-occurrence scores; 0 otherwise), as bm25s sums it. ``acc``
    (float32, one entry a passage) is zero on entry and left zero."""
    n_docs = acc.shape[0]
    for t in terms:
        for j in range(indptr[t], indptr[t + 1]):
            acc[indices[j]] += data[j]
    k = min(k, n_docs)
    scores = np.empty(k, dtype=np.float32)
    docs = np.empty(k, dtype=np.int64)
    size = 0
    floor = np.float32(0)  # what a passage must beat: 0 until the heap is full, then its worst score
    for d in range(n_docs):  # in passage order, so a later passage never wins a tie
        score = acc[d] + constant
        if score > floor:
            size = _offer(scores, docs, size, k, score, d)
            if size == k:
                floor = scores[0]
    acc[:] = 0
    out_scores = np.empty(size, dtype=np.float32)
    out_docs = np.empty(size, dtype=np.int64)
    for i in range(size - 1, -1, -1):  # the heap's root is the worst: pop it to the end
        out_scores[i], out_docs[i] = scores[0], docs[0]
        scores[0], docs[0] = scores[size - 1], docs[size - 1]
        size -= 1
        _sift_down(scores, docs, size, 0)
    return out_docs, out_scores


class Searcher:
    """Runs :func:`top_k` for queries, a batch on up to ``threads`` threads (kept between batches), each with an
    accumulator of its own (kept for the next query). A corpus under :data:`PARALLEL_MIN_PASSAGES` is searched on the
    calling thread: there a query takes less time than handing it to another thread."""

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, n_docs: int, threads: int):
        self.data, self.indices, self.indptr, self.n_docs, self.threads = data, indices, indptr, n_docs, threads
        self._buffers: queue.SimpleQueue = queue.SimpleQueue()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0
        self._lock = threading.Lock()

    def one(self, terms: np.ndarray, k: int, constant: float) -> tuple[np.ndarray, np.ndarray]:
        try:
            acc = self._buffers.get_nowait()
        except queue.Empty:
            acc = np.zeros(self.n_docs, dtype=np.float32)
        try:
            return top_k(self.data, self.indices, self.indptr, terms, k, np.float32(constant), acc)
        finally:
            self._buffers.put(acc)

    def many(self, queries: list[tuple[np.ndarray, float]], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        threads = min(self.threads, len(queries))
        if threads <= 1 or self.n_docs < PARALLEL_MIN_PASSAGES:
            return [self.one(terms, k, constant) for terms, constant in queries]
        with self._lock:
            if self._pool is None or self._pool_threads != self.threads:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="bm25")
                self._pool_threads = self.threads
            pool = self._pool
        return list(pool.map(lambda query: self.one(query[0], k, query[1]), queries))
