"""Question-answering sources: loading and normalising records into ``(id, question, answers)``.

A source is ``bigbench:<task>`` (fetched from the ``bigbench==1.0.0`` source archive with
``pip download --no-deps``, only the task file unpacked), a ``.json`` / ``.jsonl`` / ``.csv`` /
``.parquet`` file, or ``hf:<dataset id>[:split]`` (the ``datasets`` hub loader).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pandas as pd

from detectors.sources.bigbench import fetch_bigbench_task
from detectors.sources.files import read_records
from detectors.sources.ids import stable_id
from detectors.sources.text import normalize_text

QUESTION_FIELDS = ("question", "input", "query", "prompt")
ANSWER_FIELDS = ("answers", "possible_answers", "target", "answer", "targets")
ID_FIELDS = ("id", "question_id", "qid")


def _pick(record: dict[str, Any], explicit: str | None, candidates: tuple[str, ...]) -> str | None:
    if explicit is not None:
        return explicit if explicit in record else None
    return next((c for c in candidates if c in record), None)


def _as_answers(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("[") and value.endswith("]"):  # a JSON list stored in a CSV cell
            try:
                return _as_answers(json.loads(value))
            except json.JSONDecodeError:
                pass
        return [value] if value else []
    if isinstance(value, dict):  # SQuAD/TriviaQA style {"text": [...]} or {"aliases": [...]}
        for key in ("aliases", "text", "normalized_aliases", "value"):
            if key in value:
                return _as_answers(value[key])
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_as_answers(v))
        return list(dict.fromkeys(out))
    return [str(value)]


def load_raw(source: str, raw_dir: str | Path) -> list[dict[str, Any]]:
    """The source's records as dicts, fields as the source names them."""
    if source.startswith("bigbench:"):
        return fetch_bigbench_task(source.split(":", 1)[1], raw_dir)
    if source.startswith("hf:"):
        import datasets

        name, _, split = source[3:].partition(":")
        return list(datasets.load_dataset(name, split=split or "validation"))
    return read_records(Path(source))


def normalize_records(
    raw: list[dict[str, Any]],
    source: str,
    question_field: str | None = None,
    answers_field: str | None = None,
    id_field: str | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Accepted records ``(id, question, answers)`` and rejected or merged ones ``(index, id, reason)``."""
    rejected: list[dict[str, Any]] = []
    seen: dict[str, dict[str, Any]] = {}
    for i, rec in enumerate(raw):
        if not isinstance(rec, dict):
            rejected.append({"index": i, "id": None, "reason": f"not a record: {type(rec).__name__}"})
            continue
        qf = _pick(rec, question_field, QUESTION_FIELDS)
        af = _pick(rec, answers_field, ANSWER_FIELDS)
        question = unicodedata.normalize("NFC", str(rec.get(qf) or "")).strip() if qf else ""
        answers = [a for a in _as_answers(rec.get(af)) if normalize_text(a)] if af else []
        idf = _pick(rec, id_field, ID_FIELDS)
        rid = str(rec[idf]) if idf and rec.get(idf) not in (None, "") else stable_id(question, source)
        reason = None
        if not question:
            reason = f"empty question (field {qf or question_field or QUESTION_FIELDS})"
        elif not answers:
            reason = f"no usable reference answer (field {af or answers_field or ANSWER_FIELDS})"
        elif rid in seen:
            first = seen[rid]
            if first["question"] == question:  # the same question twice: its answers are all references
                first["answers"] = list(dict.fromkeys(first["answers"] + answers))
                reason = "duplicate question: answers merged into the first"
            else:
                reason = f"duplicate id (already used by {first['question'][:60]!r})"
        if reason:
            rejected.append({"index": i, "id": rid, "reason": reason})
            continue
        seen[rid] = {"id": rid, "question": question, "answers": answers}
    return pd.DataFrame(list(seen.values()), columns=["id", "question", "answers"]), pd.DataFrame(rejected, columns=["index", "id", "reason"])
