"""CtrlA's carrier statements (§3.2.1, App. C.1) and Prompt 3.1: true/false statements made from the QA
facts or read from a file, deterministic subsets, the instruction prefix and the statements' tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd

from detectors.config.schema import StatementParams
from detectors.errors import InputError
from detectors.llm.loading import LLM
from detectors.sources.files import read_records
from detectors.sources.ids import split_of, stable_id
from detectors.sources.text import normalize_text


class StatementError(InputError, ValueError):
    """The statements cannot be used: empty source, missing field, or longer than the LLM's context."""


def _relation(question: str) -> str:
    """The relation part of a fact opening ("The capital of"), used to pick type-consistent wrong answers."""
    words = question.split()
    return " ".join(words[:3]).lower()


def _rank(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def statements_from_qa(table: pd.DataFrame) -> pd.DataFrame:
    """A true and a false statement per fact: the opening with its reference answer, and with the
    answer of another fact of the same relation that is not one of its references."""
    if table.empty:
        raise StatementError("the QA table holds no facts to make statements from; run prepare first")
    by_relation: dict[str, list[str]] = {}
    for row in table.itertuples(index=False):
        by_relation.setdefault(_relation(row.question), []).append(str(row.answers[0]))
    every = sorted({str(r.answers[0]) for r in table.itertuples(index=False)})
    rows = []
    for row in table.itertuples(index=False):
        refs = {normalize_text(a) for a in row.answers}
        pool = [a for a in by_relation[_relation(row.question)] if normalize_text(a) not in refs]
        pool = pool or [a for a in every if normalize_text(a) not in refs]
        rows.append(
            {"id": f"{row.id}:true", "statement": f"{row.question} {row.answers[0]}.", "label": 1, "split": row.split}
        )
        if pool:
            wrong = min(pool, key=lambda a: _rank(row.id, a))
            rows.append(
                {"id": f"{row.id}:false", "statement": f"{row.question} {wrong}.", "label": 0, "split": row.split}
            )
    return pd.DataFrame(rows)


def load_statements(params: StatementParams, qa_table: str | Path) -> pd.DataFrame:
    """Statements with columns ``id, statement, label, split`` (``val`` and ``test`` are held out of extraction).

    ``source: qa`` makes true/false statements from the QA table (its splits); a file source
    (``.csv``/``.jsonl``/``.json``/``.parquet``, e.g. a true/false statement set such as
    ``facts_true_false.csv`` of "The Internal State of an LLM Knows When It's Lying", arXiv 2304.13734) is
    split by id hash, ``heldout`` of it shared equally by ``val`` and ``test``.
    """
    if params.source == "qa":
        if not Path(qa_table).exists():
            raise StatementError(
                f"statements.source = 'qa' but the QA table {qa_table} does not exist; run prepare first"
            )
        frame = statements_from_qa(pd.read_parquet(qa_table))
        return frame.reset_index(drop=True)  # the QA splits: extraction on train, selection on val, report on test
    path = Path(params.source)
    if not path.exists():
        raise StatementError(f"statements.source = {params.source!r}: file not found; use 'qa' or a statements file")
    records = read_records(path)
    if not records:
        raise StatementError(f"statements.source = {params.source!r} is empty: it must hold at least one statement")
    if params.text_field not in records[0]:
        raise StatementError(
            f"statements.text_field = {params.text_field!r} is not a column of {path} (columns: {sorted(records[0])}); "
            "set statements.text_field"
        )
    splits = {"train": 1 - params.heldout, "val": params.heldout / 2, "test": params.heldout / 2}
    rows = []
    for rec in records:
        text = str(rec.get(params.text_field) or "").strip()
        if not text:
            continue
        label = rec.get(params.label_field) if params.label_field else None
        rid = stable_id(text, str(path.name))
        split = split_of(rid, splits) if params.heldout > 0 else "train"
        rows.append(
            {"id": rid, "statement": text, "label": None if label in (None, "") else int(label), "split": split}
        )
    if not rows:
        raise StatementError(f"statements.source = {params.source!r}: every {params.text_field!r} is empty")
    return pd.DataFrame(rows).drop_duplicates("id").reset_index(drop=True)


def sample_statements(frame: pd.DataFrame, limit: int | None, salt: str) -> pd.DataFrame:
    """A deterministic order (by id hash): the first ``n`` rows are the ``n``-statement subset."""
    order = frame["id"].map(lambda i: _rank(salt, str(i))).sort_values().index
    frame = frame.loc[order].reset_index(drop=True)
    return frame if limit is None else frame.head(limit)


# ---- Prompt 3.1 and statement tokens --------------------------------------------------------------


def instruction_prefix(llm: LLM, instruction: str, chat: bool) -> list[int]:
    """Token ids of Prompt 3.1 up to where the statement starts (the assistant's turn in chat format)."""
    if chat:
        if not getattr(llm.tokenizer, "chat_template", None):
            raise StatementError("chat is true but the tokenizer has no chat template; set chat: false")
        text = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True
        )
        return llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    return llm.tokenizer(f"[INST] {instruction} [/INST] ", add_special_tokens=True)["input_ids"]


def statement_ids(llm: LLM, statements: list[str], max_tokens: int | None, prefix_len: int) -> list[list[int]]:
    """Token ids per statement, truncated to ``max_tokens`` (CtrlA App. C.1); refuses what exceeds the context."""
    context = getattr(llm.model.config, "max_position_embeddings", None)
    out = []
    for text in statements:
        ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise StatementError(f"statement {text!r} has no tokens")
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if context is not None and prefix_len + len(ids) > context:
            raise StatementError(
                f"statement {text[:80]!r}... has {len(ids)} tokens; with the {prefix_len}-token instruction that "
                f"exceeds "
                f"the LLM's context of {context} tokens. Set statements.max_tokens (CtrlA truncates statements) or "
                f"shorten it."
            )
        out.append(ids)
    return out
