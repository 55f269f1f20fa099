"""What every RAG procedure returns for a question (the loop, its controllers and RetroRAG alike): its retrievals, its
result with the no-passage rule, and the accounting of batched calls to the questions in them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from detectors.evaluation.answer_metrics import FAILED

NO_PASSAGE = "no passage retrieved"  # a recorded outcome: the question retrieved and every retrieval came back empty


@dataclasses.dataclass
class Retrieval:
    trigger: str  # which trigger fired
    position: int  # generated tokens kept before it (0 = before generating)
    score: float  # the trigger's score that fired
    queries: list[str]  # the query of every search sent to the retriever for this retrieval (one per search)
    passage_ids: list[str]
    passages: list[str]
    scores: list[float] = dataclasses.field(default_factory=list)  # the retriever's score of each passage
    used: bool = True  # False: a controller judged the passages and answered without them
    gate_score: float | None = None  # the judging controller's score (None: not judged)

    @classmethod
    def of(cls, trigger: str, position: int, score: float, queries: list[str], hits, **kw) -> Retrieval:
        """The retrieval of ``hits`` (:class:`~detectors.rag.retriever.Hit`)."""
        ids, texts, scores = (
            [h.passage.id for h in hits],
            [h.passage.text for h in hits],
            [float(h.score) for h in hits],
        )
        return cls(trigger, position, score, queries, ids, texts, scores, **kw)


@dataclasses.dataclass
class RagResult:
    question: str
    answer: str
    retrievals: list[Retrieval]
    forward_passes: int  # LLM forward passes the question took part in (its own, its batches', its triggers')
    generated_tokens: int  # tokens generated, discarded ones included
    wall_s: float  # its share of the batch's time, plus the cost of measurements reused from another configuration
    prompts: list[str]  # every prompt the LLM continued, in order (when recorded)
    error: str | None = None  # a recorded outcome, e.g. "no passage retrieved"


def result(
    question: str,
    answer: str,
    retrievals: list[Retrieval],
    passes: int,
    generated: int,
    seconds: float,
    prompts: list[str],
    failure: str | None = None,
) -> RagResult:
    """A question's result: ``failure`` (it could not be answered) is recorded as ``failed: <failure>`` with an empty
    answer; a question whose every retrieval came back empty is recorded as :data:`NO_PASSAGE`."""
    if failure is not None:
        return RagResult(question, "", retrievals, passes, generated, seconds, prompts, f"{FAILED} {failure}")
    error = NO_PASSAGE if retrievals and not any(r.passage_ids for r in retrievals) else None
    return RagResult(question, answer, retrievals, passes, generated, seconds, prompts, error)


def charge(owners: Sequence[Any], share_seconds: bool = False):
    """An ``on_batch`` callback (:data:`~detectors.llm.generate.OnBatch`) that charges a batched call to the questions
    with a row in it: its forward passes once to each question (``owners[i]``: anything with ``passes`` and
    ``seconds``), and with ``share_seconds`` its seconds shared by its rows."""

    def on_batch(idx: list[int], calls: int, seconds: float) -> None:
        for owner in {id(owners[i]): owners[i] for i in idx}.values():
            owner.passes += calls
        if share_seconds:
            for i in idx:
                owners[i].seconds += seconds / len(idx)

    return on_batch
