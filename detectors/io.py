"""Small file helpers shared by the stages and the library."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (a crash never leaves half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def file_digest(path: str | Path, length: int = 16) -> str:
    """SHA-256 of a file's bytes, shortened: identifies an input table in shard keys and MLflow tags."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:length]
