"""Answer and retrieval metrics of a RAG configuration: exact match, SQuAD token F1, answer containment accuracy and
the retriever's answer recall, plus :func:`summarise`, the metrics of one (corpus, configuration).

Results are the JSON-able dicts the ``rag_eval`` stage stores, one per question: ``dataclasses.asdict`` of a
:class:`~detectors.rag.loop.RagResult` plus its ``id`` (keys ``answer``, ``retrievals`` (each with ``passages``),
``forward_passes``, ``generated_tokens``, ``wall_s``, ``error``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from detectors.sources.text import contains_reference, normalize_text

METRICS = (
    "em",
    "f1",
    "accuracy",
    "retrievals_per_question",
    "searches_per_question",
    "trigger_rate",
    "forward_passes_per_question",
    "generated_tokens_per_question",
    "wall_s_per_question",
    "answer_recall_at_k",
    "n",
    "failed",
    "no_passage",
)
# how the error of a question whose loop raised starts (other errors are outcomes: "no passage retrieved")
FAILED = "failed:"
RESULT_KEYS = ("answer", "retrievals", "forward_passes", "generated_tokens", "wall_s", "error")


def exact_match(answer: str, references: Iterable[str]) -> float:
    """1.0 when the normalised answer equals some normalised reference (SQuAD EM), else 0.0."""
    normalised = normalize_text(answer)
    return float(any(normalised == normalize_text(ref) for ref in references))


def _f1(answer_words: list[str], reference_words: list[str]) -> float:
    if not answer_words or not reference_words:
        return float(answer_words == reference_words)  # both empty: 1, one empty: 0 (as SQuAD)
    common = sum((Counter(answer_words) & Counter(reference_words)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(answer_words), common / len(reference_words)
    return 2 * precision * recall / (precision + recall)


def token_f1(answer: str, references: Iterable[str]) -> float:
    """SQuAD token F1 (bag of normalised words) against the best reference; 0.0 without references."""
    words = normalize_text(answer).split()
    return max((_f1(words, normalize_text(ref).split()) for ref in references), default=0.0)


def accuracy(answer: str, references: Iterable[str]) -> float:
    """Answer containment (DioR's label rule): 1.0 when a reference occurs in the answer as whole words."""
    return float(contains_reference(answer, references))


def answer_recall(passages: Iterable[str], references: Iterable[str]) -> bool:
    """Whether one retrieval's passages hold a reference answer (containment, as :func:`accuracy`)."""
    references = list(references)
    return any(contains_reference(text, references) for text in passages)


def _check(results: Sequence[dict], answers: Sequence[Sequence[str]]) -> None:
    if len(results) != len(answers):
        raise ValueError(
            f"summarise: {len(results)} results but {len(answers)} reference lists; give one list per result"
        )
    for i, result in enumerate(results):
        missing = [k for k in RESULT_KEYS if k not in result]
        if missing:
            raise ValueError(
                f"result {i} (id {result.get('id')!r}) lacks keys {missing}: store dataclasses.asdict(RagResult) "
                f"plus its id"
            )


def summarise(results: Sequence[dict[str, Any]], answers: Sequence[Sequence[str]]) -> dict[str, float | int | None]:
    """The metrics (:data:`METRICS`) of one (corpus, configuration) over ``results`` and the matching reference
    ``answers``. Every result counts with its answer; ``failed`` counts the questions whose loop raised (error
    ``failed: ...``), ``no_passage`` those whose every retrieval came back empty (a recorded outcome).
    ``answer_recall_at_k`` is the share of retrievals whose passages hold a
    reference answer (None when nothing was retrieved); ``searches_per_question`` counts the searches the retrievals
    sent (one query each: DioR's stepwise selection sends two or more per retrieval)."""
    _check(results, answers)
    n = len(results)
    if n == 0:
        raise ValueError("summarise: no results (did the configuration answer any question?)")
    retrievals = [r["retrievals"] for r in results]
    recalled = [answer_recall(ret["passages"], refs) for rets, refs in zip(retrievals, answers) for ret in rets]
    mean = lambda values: float(sum(values) / n)  # noqa: E731
    return {
        "em": mean(exact_match(r["answer"], refs) for r, refs in zip(results, answers)),
        "f1": mean(token_f1(r["answer"], refs) for r, refs in zip(results, answers)),
        "accuracy": mean(accuracy(r["answer"], refs) for r, refs in zip(results, answers)),
        "retrievals_per_question": mean(len(rets) for rets in retrievals),
        "searches_per_question": mean(sum(len(ret["queries"]) for ret in rets) for rets in retrievals),
        "trigger_rate": mean(bool(rets) for rets in retrievals),
        "forward_passes_per_question": mean(r["forward_passes"] for r in results),
        "generated_tokens_per_question": mean(r["generated_tokens"] for r in results),
        "wall_s_per_question": mean(r["wall_s"] for r in results),
        "answer_recall_at_k": float(sum(recalled) / len(recalled)) if recalled else None,
        "n": n,
        "failed": sum(1 for r in results if str(r["error"] or "").startswith(FAILED)),
        "no_passage": sum(1 for r in results if r["error"] and not str(r["error"]).startswith(FAILED)),
    }
