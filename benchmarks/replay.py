"""Replay stored RAG runs with the current code: every configuration of ``rag_eval`` answers the first N validation
questions of its stored tuning run at the operating point it chose (``tune-val/<configuration>/<chosen>``: a replay
reads no test question), every framework the first N of its stored run (frameworks are not tuned), and each answer is
compared with the stored one field by field (the answer, every retrieval's trigger, position, queries, passages and
whether they were used, the generated tokens; scores to 4 decimals, as a batched pass's padding moves a float by
~1e-7). A refactor of the loop that claims to change nothing shows it here without rerunning the stage.

As the stage does, the reference decodings (no retrieval, and one retrieval with the question) run first for the
questions, and the configuration takes their segments where it has not retrieved. The forward passes a question is
charged depend on what ran before it (the first batch of a loop pays for the few-shot primer): they are compared only
against another replay's lines (``--against``, saved with ``--lines``), which ran under the same conditions.

    python -m benchmarks.replay --questions 40 [--configurations ctrla sit] [--lines now.jsonl] [--against old.jsonl]

Run it in a checkout whose ``rag_eval`` outputs exist (``dvc repro rag_eval`` or ``dvc pull``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def _rounded(x: float | None) -> float | str | None:
    """A score to 4 decimals; nan (no score: the sweep's and RetroRAG's first retrieval) as a string, equal to
    itself."""
    return None if x is None else "nan" if math.isnan(float(x)) else round(float(x), 4)


def comparable(line: dict, passes: bool = False) -> dict[str, Any]:
    """What must not change of a stored result (wall seconds and the recorded prompts aside; the forward passes only
    with ``passes``)."""
    keep = ("trigger", "position", "queries", "passage_ids", "used")
    retrievals = [
        {**{k: r[k] for k in keep}, "score": _rounded(r["score"]), "gate_score": _rounded(r["gate_score"])}
        for r in line["retrievals"]
    ]
    out = {"answer": line["answer"], "retrievals": retrievals, "generated_tokens": line["generated_tokens"]}
    return {**out, "error": line["error"], **({"forward_passes": line["forward_passes"]} if passes else {})}


def stored_lines(run: Path, n: int) -> list[dict]:
    """The first ``n`` stored answers of a run (in the stage's order)."""
    lines: list[dict] = []
    for shard in sorted(run.glob("shard-*.parquet")):
        frame = pd.read_parquet(shard)
        lines += [json.loads(x) for x in frame["line"]]
        if len(lines) >= n:
            break
    return lines[:n]


def differences(stored: list[dict], now: list[dict], passes: bool = False) -> list[dict]:
    out = []
    for old, new in zip(stored, now):
        a, b = comparable(old, passes), comparable(new, passes)
        if a != b:
            fields = [k for k in a if a[k] != b[k]]
            changed = {"stored": {k: a[k] for k in fields}, "now": {k: b[k] for k in fields}}
            out.append({"question": old["question"], "fields": fields, **changed})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--questions", type=int, default=40, help="the first N stored answers of each run")
    parser.add_argument("--configurations", nargs="*", default=None, help="default: every configuration and framework")
    parser.add_argument("--corpora", nargs="*", default=None)
    parser.add_argument("--lines", default=None, help="save the replayed answers here (JSON lines)")
    parser.add_argument("--against", default=None, help="also compare with this earlier --lines file, passes included")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/replay.json"))
    args = parser.parse_args(argv)

    from detectors.config import StageParams
    from detectors.rag.runtime import RagRuntime

    p = StageParams.of("rag_eval", args.params)
    rag = p["rag_eval"]
    metrics = Path(p["paths.rag_metrics"])
    if not metrics.exists():
        raise SystemExit(f"{metrics} is missing: run `dvc repro rag_eval` first (the replay reruns its stored runs)")
    tuning = json.loads(metrics.read_text())["tuning"]
    runtime = RagRuntime(p)
    names = args.configurations or [*rag.configurations, *rag.frameworks]
    out: dict[str, Any] = {"questions": args.questions, "runs": {}}
    earlier: dict[str, list[dict]] = {}
    if args.against:
        for line in map(json.loads, Path(args.against).read_text().splitlines()):
            earlier.setdefault(line.pop("run"), []).append(line)
    saved = open(args.lines, "w") if args.lines else None
    for corpus in args.corpora or rag.corpora:
        for name in names:
            runs = Path(p["paths.rag_runs"]) / corpus
            runtime.forget_loops()
            if name in rag.frameworks:
                stored = stored_lines(runs / name, args.questions)
                answer = runtime.framework(name, corpus).answer
            else:
                chosen = tuning[corpus][name]
                stored = stored_lines(runs / "tune-val" / name / str(chosen["chosen"]), args.questions)
                answer = runtime.configuration(name, corpus, chosen["thresholds"]).answer
            questions = [line["question"] for line in stored]
            began = time.perf_counter()
            runtime.references(corpus, questions)
            now = answer(questions, [False] * len(stored))
            run = f"{corpus}/{name}"
            diff = differences(stored, now)
            out["runs"][run] = {"questions": len(stored), "identical": len(stored) - len(diff), "differences": diff}
            out["runs"][run]["seconds"] = round(time.perf_counter() - began, 1)
            said = f"{run}: {len(stored) - len(diff)}/{len(stored)} as stored"
            if run in earlier:
                again = differences(earlier[run], now, passes=True)
                out["runs"][run].update(identical_to_earlier=len(now) - len(again), earlier_differences=again)
                said += f", {len(now) - len(again)}/{len(now)} as the earlier replay (passes included)"
            print(said, flush=True)
            if saved:
                saved.writelines(json.dumps({"run": run, **line}) + "\n" for line in now)
                saved.flush()
            runtime.forget_shared()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
