"""A RAG system as an evaluation runs it, and the resumable runs that store its answers.

A :class:`RagSystem` answers a batch of questions and says what shapes its answers: the digest of the code it runs
(``code``) and its own settings (``key``: params, thresholds, the registered versions it reads). A loop configuration
(:class:`~detectors.rag.loop.RagLoop` with its triggers and query), a seed framework with its own loop (RetroRAG) and a
trigger sweep are all built as one (:class:`System`, by :class:`~detectors.rag.runtime.RagRuntime`); a user's own
system only needs the three attributes and :meth:`RagSystem.answer`.

:func:`run_questions` answers a set of questions with several systems, question-major, each in a
:class:`~detectors.shards.ShardStore` keyed on the system's key plus what the evaluation shares (the questions, the
LLM, the corpus): a killed run resumes where it stopped, and a run stored under another key starts again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from detectors.evaluation.answer_metrics import FAILED
from detectors.execution import batch_or_each
from detectors.progress import progress
from detectors.rag.results import RagResult, result
from detectors.shards import ERROR, OK, ShardStore

log = logging.getLogger(__name__)

Answer = Callable[[list[str], list[bool]], list[dict]]


class RagSystem(Protocol):
    """What an evaluation runs: ``answer(questions, records)`` returns one JSON-able
    :class:`~detectors.rag.results.RagResult` dict per question (``records[i]``: keep question i's prompts);
    ``code`` is the digest of the code it runs and ``key`` its own settings: a change to either starts its stored
    answers again."""

    name: str
    code: str
    key: dict[str, Any]

    def answer(self, questions: list[str], records: list[bool]) -> list[dict]: ...


@dataclasses.dataclass
class System:
    """A :class:`RagSystem` from an answer function."""

    name: str
    answer: Answer
    code: str
    key: dict[str, Any] = dataclasses.field(default_factory=dict)


def resilient(name: str, answer_all: Callable[[list[str], list[bool]], list[RagResult]]) -> Answer:
    """``answer_all`` as JSON-able dicts; when a batch raises, its questions are answered one by one
    (:func:`~detectors.execution.batch_or_each`), so that only a question that raises alone is recorded as failed
    (``failed: <error>``: never a crash halfway; the stage stops if most questions fail) and the others are answered."""

    def answer(questions: list[str], records: list[bool]) -> list[dict]:
        pairs = list(zip(questions, records))
        answered = batch_or_each(
            lambda batch: answer_all([q for q, _ in batch], [r for _, r in batch]), pairs, f"{name}: a batch"
        )
        return [
            dataclasses.asdict(result(q, "", [], 0, 0, 0.0, [], f"{type(r).__name__}: {r}"))
            if isinstance(r, Exception)
            else dataclasses.asdict(r)
            for (q, _), r in zip(pairs, answered)
        ]

    return answer


@dataclasses.dataclass
class Run:
    """One resumable run of ``system``: its shard store's ``directory``, keyed on ``shared`` (what the evaluation's
    runs share: the questions' table, the LLM, the corpus) plus the system's code and key; the first
    ``prompts_sample`` questions record their prompts."""

    system: RagSystem
    directory: Path
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompts_sample: int = 0

    @property
    def name(self) -> str:
        return self.system.name

    @property
    def key(self) -> dict[str, Any]:
        return {**self.shared, "code": self.system.code, **self.system.key}


def run_questions(
    runs: list[Run],
    rows: pd.DataFrame,
    desc: str,
    shard_size: int,
    on_shard: Callable[[list[str]], None] | None = None,
) -> dict[str, list[dict]]:
    """Answer every row (``id``, ``question``) in every run, question-major: shard after shard of ``shard_size``
    questions, each shard answered by every run that lacks it before the next (``on_shard(questions)`` is called with
    the shard's questions before each, so that what the runs share about a shard's questions, their decodings, stays
    small and is decoded first). Each run is a :class:`~detectors.shards.ShardStore` under its directory keyed on its
    key (another key starts it again): a killed evaluation resumes where it stopped. A row is ``id``, ``status``
    (``error: …`` for a question whose loop raised, computed again by the next run) and ``line`` (its result as JSON).
    Returns each run's lines of every row, in the rows' order."""
    ids = hashlib.sha256("\x1f".join(rows["id"]).encode()).hexdigest()[:16]  # the shards cover exactly these questions
    table = rows[["id", "question"]].reset_index(drop=True)
    stores = {
        r.name: ShardStore(r.directory, {**r.key, "questions_digest": ids, "shard_size": shard_size}) for r in runs
    }
    todo = {r.name: dict(stores[r.name].todo(table, shard_size)) for r in runs}
    shards = sorted({k for t in todo.values() for k in t})
    left = sum(len(chunk) for t in todo.values() for chunk in t.values())
    total = len(table) * len(runs)
    with progress(total=total, initial=total - left, desc=desc, unit="answer") as bar:
        for k in shards:
            if on_shard is not None:
                on_shard(list(table["question"].iloc[k * shard_size : (k + 1) * shard_size]))
            for r in runs:
                if k not in todo[r.name]:
                    continue
                chunk = todo[r.name][k]
                results = r.system.answer(list(chunk["question"]), [i < r.prompts_sample for i in chunk.index])
                status = [
                    f"{ERROR}{x['error']}" if str(x.get("error") or "").startswith(FAILED) else OK for x in results
                ]
                stores[r.name].write(
                    k,
                    pd.DataFrame({"id": list(chunk["id"]), "status": status, "line": [json.dumps(x) for x in results]}),
                )
                bar.update(len(chunk))
    out = {}
    for r in runs:
        frame = stores[r.name].read_all(len(table), shard_size)
        out[r.name] = [{"id": i, **json.loads(line)} for i, line in zip(frame["id"], frame["line"])]
    return out
