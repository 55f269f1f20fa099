"""Question-answering sources: loading, normalisation, stable ids, splits and the containment label.

A source is ``bigbench:<task>`` (fetched from the ``bigbench==1.0.0`` source archive with
``pip download --no-deps``, only the task file unpacked), a ``.json`` / ``.jsonl`` / ``.csv`` /
``.parquet`` file, or ``hf:<dataset id>[:split]`` (the ``datasets`` hub loader).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import string
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

log = logging.getLogger(__name__)

BIGBENCH_VERSION = "1.0.0"
QUESTION_FIELDS = ("question", "input", "query", "prompt")
ANSWER_FIELDS = ("answers", "possible_answers", "target", "answer", "targets")
ID_FIELDS = ("id", "question_id", "qid")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


class SourceError(ValueError):
    """The QA source cannot be read or holds no usable record."""


def normalize_text(text: str) -> str:
    """SQuAD-style normalisation made unicode-aware: NFKC, accents and punctuation removed, lowercase,
    articles dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = "".join(" " if (c in _PUNCT or unicodedata.category(c).startswith("P")) else c for c in text.lower())
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def contains_reference(answer: str, references: Iterable[str]) -> bool:
    """DioR's label rule R ⊆ A: some normalised reference occurs in the normalised answer as whole words."""
    words = normalize_text(answer).split()
    for ref in references:
        ref_words = normalize_text(ref).split()
        n = len(ref_words)
        if n and any(words[i : i + n] == ref_words for i in range(len(words) - n + 1)):
            return True
    return False


def stable_id(question: str, source: str) -> str:
    return hashlib.sha1(f"{source}\x1f{question.strip()}".encode()).hexdigest()[:16]


def split_of(record_id: str, ratios: dict[str, float]) -> str:
    """Deterministic split from the id's hash: the same id lands in the same split on every machine."""
    u = int(hashlib.sha256(record_id.encode()).hexdigest()[:12], 16) / float(16**12)
    edge = 0.0
    for name in ("train", "val", "test"):
        edge += ratios[name]
        if u < edge:
            return name
    return "test"


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


def fetch_bigbench_task(task: str, raw_dir: str | Path, file: str = "task.json") -> list[dict[str, Any]]:
    """The examples of a bigbench task, from the source archive on PyPI (downloaded once into
    ``raw_dir``, so later tasks read the same archive; each task file is unpacked on first use).

    ``file`` names the task's JSON when it is not ``task.json`` (``truthful_qa`` has ``task_mc.json``).
    """
    raw = Path(raw_dir) / "bigbench"
    task_file = raw / task / file
    if not task_file.exists():
        task_file.parent.mkdir(parents=True, exist_ok=True)
        archive = next(raw.glob(f"bigbench-{BIGBENCH_VERSION}.tar.gz"), None)
        if archive is None:
            log.info("downloading the bigbench==%s source archive (once)", BIGBENCH_VERSION)
            with tempfile.TemporaryDirectory(dir=raw) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp, f"bigbench=={BIGBENCH_VERSION}"]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SourceError(f"could not download bigbench=={BIGBENCH_VERSION}: {done.stderr.strip()[-500:]}")
                archive = raw / f"bigbench-{BIGBENCH_VERSION}.tar.gz"
                next(Path(tmp).glob("bigbench-*.tar.gz")).replace(archive)
        member = f"bigbench-{BIGBENCH_VERSION}/bigbench/benchmark_tasks/{task}/{file}"
        with tarfile.open(archive) as tar:
            try:
                fobj = tar.extractfile(member)
            except KeyError:
                raise SourceError(f"bigbench:{task}: no file {file!r} for that task in bigbench {BIGBENCH_VERSION}") from None
            tmp_file = task_file.with_suffix(".part")
            tmp_file.write_bytes(fobj.read())
            tmp_file.replace(task_file)
    return json.loads(task_file.read_text())["examples"]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise SourceError(f"qa.source = {str(path)!r}: file not found")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise SourceError(f"{path}:{n}: not valid JSON ({err.msg}); fix or remove that line") from err
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            data = data.get("examples", data.get("data"))
        if not isinstance(data, list):
            raise SourceError(f"{path}: expected a list of records (or {{'examples': [...]}})")
        return data
    if suffix == ".csv":
        return pd.read_csv(path, dtype=str, keep_default_na=False).to_dict("records")
    if suffix == ".parquet":
        return pd.read_parquet(path).to_dict("records")
    raise SourceError(f"qa.source = {str(path)!r}: unsupported file type {suffix!r}; use .json, .jsonl, .csv or .parquet")


def load_raw(source: str, raw_dir: str | Path) -> list[dict[str, Any]]:
    """The source's records as dicts, fields as the source names them."""
    if source.startswith("bigbench:"):
        return fetch_bigbench_task(source.split(":", 1)[1], raw_dir)
    if source.startswith("hf:"):
        import datasets

        name, _, split = source[3:].partition(":")
        return list(datasets.load_dataset(name, split=split or "validation"))
    return _read_file(Path(source))


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


def sample(df: pd.DataFrame, limit: int | None) -> pd.DataFrame:
    """A deterministic subset of ``limit`` records (by id hash), independent of the source's order."""
    if limit is None or limit >= len(df):
        return df
    keys = df["id"].map(lambda i: hashlib.sha256(f"sample\x1f{i}".encode()).hexdigest())
    return df.loc[keys.sort_values().index[:limit]].sort_index().reset_index(drop=True)
