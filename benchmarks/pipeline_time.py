"""Minutes per stage of a whole pipeline run: ``make repro`` (creating ``.venv``, then ``dvc repro``) in a checkout,
each stage timed from DVC's "Running stage" line to the next (the first stage's clock starts when ``.venv`` is ready).

What it measures: the wall time a newcomer waits for a fresh clone's first result, and where it goes. Run it in a fresh
clone with nothing else on the machine (two CPU jobs distort each other); the result names the machine, the commit and
the LLM's dtype.

Run: ``python -m benchmarks.pipeline_time --checkout /path/to/fresh/clone [--out benchmarks/results/pipeline_cpu.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

STAGE = re.compile(r"^Running stage '([^']+)'")


def timed_run(command: list[str], cwd: Path, log: Path) -> tuple[float, list[tuple[str, float]]]:
    """Run ``command`` in ``cwd``, its output copied to ``log`` and stderr; the total seconds and (stage, start)
    marks."""
    marks: list[tuple[str, float]] = []
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        for line in proc.stdout:  # type: ignore[union-attr]
            out.write(line)
            sys.stderr.write(line)
            if m := STAGE.match(line):
                marks.append((m.group(1), time.perf_counter() - start))
        if proc.wait():
            raise SystemExit(f"{' '.join(command)} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start, marks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="a fresh clone of the project (its .venv is created by make)")
    parser.add_argument("--command", default="make repro")
    parser.add_argument("--out", default="benchmarks/results/pipeline_cpu.json")
    args = parser.parse_args(argv)
    checkout = Path(args.checkout).resolve()
    total, marks = timed_run(args.command.split(), checkout, checkout / "repro.log")
    ends = [t for _, t in marks[1:]] + [total]
    stages = {name: round((end - begin) / 60, 2) for (name, begin), end in zip(marks, ends)}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True
    ).stdout.strip()
    metrics = checkout / "data/metrics/score_baselines.json"  # it records the dtype the LLM ran in
    dtype = json.loads(metrics.read_text()).get("dtype") if metrics.exists() else None
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "commit": commit,
        "command": args.command,
        "llm_dtype": dtype,
        "total_minutes": round(total / 60, 2),
        "setup_minutes": round((marks[0][1] if marks else total) / 60, 2),
        "stage_minutes": stages,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
