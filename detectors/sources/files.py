"""Records from a ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file (QA pairs, statements)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from detectors.errors import SourceError


def read_records(path: Path) -> list[dict[str, Any]]:
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
    raise SourceError(
        f"qa.source = {str(path)!r}: unsupported file type {suffix!r}; use .json, .jsonl, .csv or .parquet"
    )
