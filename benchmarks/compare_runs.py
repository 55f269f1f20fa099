"""Two runs of the pipeline compared leaf by leaf: what a rerun must reproduce.

For two project directories (e.g. a fresh clone after ``make repro`` and an earlier one), every JSON file under
``data/metrics/`` present in either is flattened to its leaves (``file: key.key[i]``) and compared: equal, within
``--tolerance`` for numbers, or different; then every line of the results pages (``docs/results/*.md``) that differs.
Keys with a part whose name says it holds times or where a run happened (``seconds``, ``wall_s``, ``minutes``,
``started``, ``commit``, ...) are left out by default (``--keep-times`` keeps them). Prints one line per difference and
a summary; exits 0 either way (a difference is for a person to read: the closing note lists the rows that moved and
why).

Run: ``python -m benchmarks.compare_runs NEW OLD [--tolerance 0] [--keep-times]``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

TIMES = re.compile(r"(seconds|wall_s|_s$|_time$|minutes|elapsed|started|finished|commit|timestamp|date|host|machine)")


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a JSON value by its path (``a.b[2].c``)."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}.{key}" if prefix else key).items()
        }
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{prefix}[{i}]").items()}
    return {prefix: value}


def same(a: Any, b: Any, tolerance: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tolerance
    return a == b


def compare(new: Path, old: Path, tolerance: float = 0.0, keep_times: bool = False) -> list[str]:
    """The differences between the runs in ``new`` and ``old``, one line each."""
    out = []
    names = sorted(
        {p.relative_to(root).as_posix() for root in (new, old) for p in (root / "data/metrics").rglob("*.json")}
    )
    for name in names:
        a, b = ((root / name) for root in (new, old))
        if not (a.exists() and b.exists()):
            out.append(f"{name}: only in {'new' if a.exists() else 'old'}")
            continue
        la, lb = leaves(json.loads(a.read_text())), leaves(json.loads(b.read_text()))
        for key in sorted(set(la) | set(lb)):
            if not keep_times and any(TIMES.search(part) for part in re.split(r"[.\[]", key)):
                continue
            if key not in la or key not in lb:
                out.append(f"{name}: {key} only in {'new' if key in la else 'old'}")
            elif not same(la[key], lb[key], tolerance):
                out.append(f"{name}: {key}: {lb[key]!r} -> {la[key]!r}")
    pages = sorted({p.name for root in (new, old) for p in (root / "docs/results").glob("*.md")})
    for page in pages:
        a, b = ((root / "docs/results" / page) for root in (new, old))
        lines = [p.read_text().splitlines() if p.exists() else [] for p in (a, b)]
        out += [f"docs/results/{page}: {y!r} -> {x!r}" for x, y in zip(*lines) if x != y]
        if len(lines[0]) != len(lines[1]):
            out.append(f"docs/results/{page}: {len(lines[1])} lines -> {len(lines[0])} lines")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("new", type=Path)
    parser.add_argument("old", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.0, help="numbers closer than this are equal")
    parser.add_argument("--keep-times", action="store_true", help="compare times and run records too")
    args = parser.parse_args(argv)
    differences = compare(args.new, args.old, args.tolerance, args.keep_times)
    print("\n".join(differences))
    print(f"{len(differences)} differences between {args.new} and {args.old}")


if __name__ == "__main__":
    main()
