"""Retrieval-utility labels (SKR, Probing-RAG: label the retrieval decision by answering with and without retrieval).

For each question the LLM answers without passages (the early set's greedy answer: the same prompt and decoding as the
RAG loop's no-retrieval answer) and with the top-k passages retrieved with the question, by the RAG loop itself (an
``always`` trigger: single-round RAG's answer). The label is ``helps`` (wrong without, right with), ``hurts`` (right
without, wrong with) or ``neither``, by answer containment, the RAG evaluation's accuracy.

What a trigger can know at each decision is kept beside the label: before retrieval, the early set's columns (joined by
id); after it, what the loop's gate sees once the passages' prompt has run
(:class:`~detectors.rag.controllers.gate.PostRetrieval`:
the first-token distribution and last-prompt hidden state with the passages, the retriever's scores), recorded by a
gate that keeps every retrieval (:class:`RecordingGate`), and whether the two answers agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from detectors.evaluation.answer_metrics import accuracy

HELPS, HURTS, NEITHER = "helps", "hurts", "neither"
LABELS = (HELPS, HURTS, NEITHER)
POST = "post_"  # prefix of the post-retrieval columns
SCORES = (
    "retrieval_scores"  # the one post-retrieval column stored under its own name (the early set has no such column)
)


def utility_label(correct_without: bool, correct_with: bool) -> str:
    """``helps`` (wrong -> right), ``hurts`` (right -> wrong) or ``neither``."""
    if correct_with and not correct_without:
        return HELPS
    if correct_without and not correct_with:
        return HURTS
    return NEITHER


class RecordingGate:
    """A gate that keeps every retrieval and records what it saw, by question (the labels' post-retrieval columns)."""

    key = "utility-post"
    threshold = -math.inf

    def __init__(self, llm, layers: Sequence[int]):
        from detectors.llm.layers import StateTap

        self.probe = StateTap(llm.model, list(layers))
        self.seen: dict[str, Any] = {}

    def judge(self, items: list) -> list[float]:
        for item in items:
            self.seen[item.question] = item
        return [1.0] * len(items)


def post_features(item) -> dict[str, Any]:
    """What a gate reads of a :class:`~detectors.rag.controllers.gate.PostRetrieval`, under the early set's names: the
    first-token
    statistics with the passages, the hidden state (a list, as stored) and the retriever's scores. The labels store
    them (:func:`post_columns`) and the utility trigger's gate reads them in the loop: the same features both ways."""
    return {
        "first_token_prob": item.first_token_prob,
        "first_token_entropy": item.first_token_entropy,
        "first_token_margin": item.first_token_margin,
        "hidden": None if item.hidden is None else item.hidden.tolist(),
        SCORES: list(item.retrieval_scores),
    }


def post_columns(item) -> dict[str, Any]:
    """The stored post-retrieval columns of a :class:`~detectors.rag.controllers.gate.PostRetrieval`:
    :func:`post_features`
    prefixed with ``post_`` (the early set has columns of the same names), the retriever's scores as they are."""
    return {k if k == SCORES else POST + k: v for k, v in post_features(item).items()}


def as_post(row: dict) -> dict[str, Any]:
    """A labels row's post-retrieval columns under the early set's names (:func:`post_features` of what was stored)."""
    return {k[len(POST) :]: v for k, v in row.items() if k.startswith(POST)} | {SCORES: row[SCORES]}


def utility_records(
    loop, gate: RecordingGate, questions: list[str], references: list[list[str]], answers_without: list[str]
) -> list[dict]:
    """One labels row per question: the answer with the passages ``loop`` retrieves (its trigger must be ``always``
    with ``gate``), both answers' correctness, the label, the post-retrieval columns and the passages' ids. A question
    the loop could not answer comes back with its ``error`` and no label; one whose retrieval found no passage is
    labelled like any other (its two answers are the same)."""
    results = loop.answer_all(questions)
    out = []
    for question, refs, without, result in zip(questions, references, answers_without, results):
        seen = gate.seen.get(question)
        if seen is None:  # the loop failed before the passages' prompt ran (an unusable question)
            out.append({"answer_with": result.answer, "error": result.error or "the passages' prompt did not run"})
            continue
        right_without, right_with = bool(accuracy(without, refs)), bool(accuracy(result.answer, refs))
        out.append(
            {
                "answer_with": result.answer,
                "correct_without": right_without,
                "correct_with": right_with,
                "utility": utility_label(right_without, right_with),
                "answers_agree": without.strip().lower() == result.answer.strip().lower(),
                "passage_ids": result.retrievals[0].passage_ids,
                "error": None,
                **post_columns(seen),
            }
        )
    gate.seen.clear()
    return out


def balance(frame) -> dict[str, dict[str, Any]]:
    """Label counts and shares per split of a labels table (one corpus)."""
    out = {}
    for split, group in frame.groupby("split"):
        counts = {label: int((group["utility"] == label).sum()) for label in LABELS}
        n = max(len(group), 1)
        out[str(split)] = {
            "n": int(len(group)),
            **counts,
            **{f"{label}_rate": round(c / n, 4) for label, c in counts.items()},
            "accuracy_without": round(float(np.mean(group["correct_without"])), 4),
            "accuracy_with": round(float(np.mean(group["correct_with"])), 4),
        }
    return out
