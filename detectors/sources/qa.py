"""Question-answering sources: loading and normalising records into ``(id, question, answers)``.

A source is ``bigbench:<task>`` (fetched from the ``bigbench==1.0.0`` source archive with
``pip download --no-deps``, only the task file unpacked), a ``.json`` / ``.jsonl`` / ``.csv`` /
``.parquet`` file, or ``hf:<dataset id>[:<config>]:<split>`` (``datasets.load_dataset``; ``hf:<dataset id>`` alone
reads the validation split). The dataset id is a hub id (``hotpotqa/hotpot_qa``) or a local directory of data files,
whose configs are those its ``README.md`` declares, as on the hub (:func:`parse_hf_source`).
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pandas as pd

from detectors.errors import SourceError
from detectors.sources.bigbench import fetch_bigbench_task
from detectors.sources.files import read_records
from detectors.sources.ids import stable_id
from detectors.sources.text import normalize_text

QUESTION_FIELDS = ("question", "input", "query", "prompt")
ANSWER_FIELDS = ("answers", "possible_answers", "target", "answer", "targets")
ID_FIELDS = ("id", "question_id", "qid", "_id")  # _id: 2WikiMultihopQA's
HF = "hf:"
HF_SYNTAX = "hf:<dataset id>[:<config>]:<split> (hf:<dataset id> alone: its validation split)"


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


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """``(dataset id, config, split)`` of an ``hf:`` source: ``hf:<id>`` is ``(id, None, "validation")``,
    ``hf:<id>:<split>`` ``(id, None, split)`` and ``hf:<id>:<config>:<split>`` ``(id, config, split)``, e.g.
    ``hf:hotpotqa/hotpot_qa:distractor:validation``. Any other shape is a :class:`SourceError` naming the source."""
    parts = source.removeprefix(HF).split(":")
    if not source.startswith(HF) or len(parts) > 3 or any(not part.strip() for part in parts):
        raise SourceError(
            f"qa.source = {source!r}: write {HF_SYNTAX}, each part non-empty, "
            "e.g. hf:hotpotqa/hotpot_qa:distractor:validation"
        )
    if len(parts) == 1:
        return parts[0], None, "validation"
    return parts[0], parts[1] if len(parts) == 3 else None, parts[-1]


def load_raw(source: str, raw_dir: str | Path) -> list[dict[str, Any]]:
    """The source's records as dicts, fields as the source names them."""
    if source.startswith("bigbench:"):
        return fetch_bigbench_task(source.split(":", 1)[1], raw_dir)
    if source.startswith(HF):
        import datasets

        name, config, split = parse_hf_source(source)
        try:
            return list(datasets.load_dataset(name, config, split=split))
        except (ValueError, OSError) as err:  # an unknown config or split, no such dataset, offline without a copy
            raise SourceError(
                f"qa.source = {source!r}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) "
                f"failed: {err} (write {HF_SYNTAX}; a hub dataset must be downloaded or reachable)"
            ) from err
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
    return pd.DataFrame(list(seen.values()), columns=["id", "question", "answers"]), pd.DataFrame(
        rejected, columns=["index", "id", "reason"]
    )
