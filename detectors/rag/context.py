"""DioR's post-retrieval (§3.3.2): stepwise selection of passages, sentence-level chunking, and the passages
block the prompt shows the LLM."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from detectors.llm.words import DEFAULT_STOPWORDS
from detectors.sources.text import split_sentences

if TYPE_CHECKING:
    from detectors.config.schema import PromptParams

_CLAUSES = re.compile(r"(?<=[,;:])\s+")
_WORD = re.compile(r"\w\w\w+")


def _terms(text: str) -> list[str]:
    """Lower-cased words of three letters or more, stop words dropped (accents kept: the index keeps them)."""
    return [w for w in _WORD.findall(text.lower()) if w not in DEFAULT_STOPWORDS]


def stepwise_retrieve(retriever, query: str, k: int, idf: Callable[[str], float] | None = None, new_terms: int = 5):
    """Choose ``ceil(n/2)`` of the ``n`` passages still needed from the best hits not chosen yet, add the chosen
    passages' new concepts (words not in the query, by tf×idf, or tf without ``idf``) to the query, and search
    again, until ``k`` passages are chosen or nothing new is found. Returns the chosen hits (ranked 1..) and the query
    of every search issued, in order (one per search: a retrieval's cost in searches)."""
    from detectors.rag.retriever import Hit

    chosen, queries, current = [], [], query
    while len(chosen) < k:
        queries.append(current)
        seen = {h.passage.id for h in chosen}
        fresh = [h for h in retriever.search(current, k + len(chosen)) if h.passage.id not in seen]
        if not fresh:
            break
        take = fresh[: math.ceil((k - len(chosen)) / 2)]
        chosen += take
        if len(chosen) >= k:
            break
        known = set(_terms(current))
        counts = Counter(t for h in take for t in _terms(h.passage.text) if t not in known)
        ranked = sorted(counts, key=lambda t: (-(counts[t] * (idf(t) if idf else 1.0)), t))[:new_terms]
        if ranked:
            current = f"{current} {' '.join(ranked)}"
    return [Hit(h.passage, h.score, r + 1) for r, h in enumerate(chosen)], queries


def find_passages(retriever, queries: list[str], k: int, stepwise: bool) -> list[tuple[list, list[str]]]:
    """The passages of each query and the query of every search issued for them: one batched search (one query), or
    DioR's stepwise selection (:func:`stepwise_retrieve`, two searches or more) per query."""
    if stepwise:
        return [stepwise_retrieve(retriever, q, k, getattr(retriever, "idf", None)) for q in queries]
    return [(hits, [q]) for hits, q in zip(retriever.batch_search(list(queries), k), queries)]


def _relevance(words: list[str], query_terms: set[str]) -> float:
    """Distinct query terms in the block over the square root of its length: grows when a clause brings query terms,
    shrinks when it only adds length (a length-normalised overlap, like BM25's saturation and length penalty)."""
    if not words:
        return 0.0
    return len(query_terms & set(_terms(" ".join(words)))) / math.sqrt(len(words))


def chunk_passage(text: str, query: str) -> list[str]:
    """Blocks of whole clauses: each sentence is split at , ; : and a block grows clause by clause while its
    relevance to the query does not drop; a new block starts at the first clause that would lower it. Blocks never
    cross sentences and together hold every word of the text once."""
    q = set(_terms(query))
    blocks: list[str] = []
    for sentence in split_sentences(text):
        block: list[str] = []
        for clause in (c for c in _CLAUSES.split(sentence) if c):
            if block and _relevance((" ".join(block + [clause])).split(), q) < _relevance(" ".join(block).split(), q):
                blocks.append(" ".join(block))
                block = []
            block.append(clause)
        if block:
            blocks.append(" ".join(block))
    return blocks


def render_passages(hits, chunked: bool, query: str) -> str:
    """The passages as the prompt shows them: ``[1] title: text`` lines, or DioR's "External Knowledge After Chunk"
    block with each passage's numbered blocks when ``chunked``."""
    lines = []
    for i, h in enumerate(hits, start=1):
        title = f"{h.passage.title}: " if h.passage.title else ""
        body = (
            " ".join(f"({j}). {b}" for j, b in enumerate(chunk_passage(h.passage.text, query), start=1))
            if chunked
            else h.passage.text
        )
        lines.append(f"[{i}] {title}{body}")
    head = "External Knowledge After Chunk:\n" if chunked else ""
    return head + "\n".join(lines)


def with_context(prompt: PromptParams, block: str) -> PromptParams:
    """The question prompt with ``block`` (passages, evidence) right before its ``{question}``: where every RAG prompt
    of the project puts what was retrieved."""
    return dataclasses.replace(prompt, template=prompt.template.replace("{question}", block + "{question}", 1))
