"""Speed of the RAG evaluation: today's loop (many questions at once) against the loop it replaced (one question at a
time), on the same questions, configurations, corpora, LLM and registered detectors.

What it measures
----------------
For the first ``--questions`` test questions of ``rag_eval``'s sample, every configuration of ``rag_eval`` over every
corpus (a configuration without triggers on the first corpus only, as the stage does) and the accuracy vs
retrieval-rate sweep answer the questions twice:

* **reference**: the loop of ``--reference`` (a git commit, default ``19913cf``: the last one-question-at-a-time loop),
  checked out into a temporary git worktree and run in a child process with that commit's code and params file (its
  ``rag_eval`` paths point at the same data, index and registry);
* **ours**: this checkout's loop, ``rag_eval.batch_size`` questions at a time; and on the first ``--batch-one``
  questions one at a time, to check that batching changes no answer nor retrieval on the real LLM.

Both time only the answering (loading the LLM, the detectors and the indexes is left out), in configuration order, so
that the early detector's assessment of a question is paid by the first configuration that needs it on both sides.
Reported per configuration × corpus: seconds per question both ways and their ratio, and how many answers and
retrieval traces (trigger, position, queries, passages) are identical; overall, the ratio of the total times.
Timings are reported, never asserted. Run nothing else on the machine meanwhile (two CPU jobs distort each other).

Run: ``python -m benchmarks.rag_speed [--questions N] [--reference COMMIT] [--out PATH]`` after ``dvc repro
index_corpus`` (and the stages before it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = "sweep"


def units(params) -> list[tuple[str, str]]:
    """(corpus, configuration) in the stage's order, then the sweep."""
    first = params.corpora[0]
    out = [(c, n) for c in params.corpora for n, config in params.configurations.items() if config.triggers or c == first]
    return out + [(params.sweep.corpus, SWEEP)]


def trace(line: dict) -> list:
    """What must not change: the retrievals (trigger, position, queries, passages), as JSON stores them (the reference's
    come from another process through JSON)."""
    return json.loads(json.dumps([[r["trigger"], r["position"], r["queries"], r["passage_ids"]] for r in line.get("retrievals", [])]))


def run_side(side: str, params_path: str, n: int, only: list[str] | None, batch_size: int | None = None) -> dict:
    """Answer the questions with the loop of the importable code (this checkout, or the reference worktree); ours
    ``batch_size`` questions at a time (None: ``rag_eval.batch_size``)."""
    import dataclasses

    import pandas as pd
    import torch

    from pipelines import rag_eval as stage
    from pipelines._rag_runtime import RagRuntime
    from pipelines._stage import stage_params

    p = stage_params(stage.__doc__, ["--params", params_path], stage.READS, "rag_eval")
    params = p["rag_eval"]
    rows = stage.sample_questions(pd.read_parquet(p["paths.qa"]), None).head(n)
    questions, refs = list(rows["question"]), [list(a) for a in rows["answers"]]
    comparison = pd.read_parquet(p["paths.comparison"]) if Path(p["paths.comparison"]).exists() else None
    runtime = RagRuntime(p, stage.resolve_thresholds(params.thresholds, comparison))
    if batch_size is not None:
        runtime.params = dataclasses.replace(params, batch_size=batch_size)
    out = {"side": side, "threads": torch.get_num_threads(), "questions": len(questions), "units": {}}
    for corpus, name in units(params):
        if only and name not in only:
            continue
        batched = side == "ours"
        if name == SWEEP:
            sweep, _ = runtime.sweep_loop(corpus)
            start = time.perf_counter()
            lines = sweep(questions, refs) if batched else [sweep(q, r) for q, r in zip(questions, refs)]
            answers = [{"answer": line["never_answer"], "retrievals": [], "after": line["answers"]} for line in lines]
        else:
            answer = runtime.loop(name, params.configurations[name], corpus)
            start = time.perf_counter()
            answers = answer(questions, [False] * len(questions)) if batched else [answer(q, False) for q in questions]
        seconds = time.perf_counter() - start
        out["units"][f"{corpus} · {name}"] = {"seconds": seconds, "answers": [a["answer"] for a in answers],
                                              "traces": [trace(a) for a in answers], "after": [a.get("after") for a in answers]}  # fmt: skip
        print(f"{side}: {corpus} · {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return out


def reference_side(commit: str, n: int, only: list[str] | None) -> dict:
    """The reference loop in a child process: ``commit`` checked out into a temporary worktree, first on the path."""
    with tempfile.TemporaryDirectory(prefix="rag-reference-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, str(Path(__file__)), "--side", "reference", "--params", str(tree / "params.yaml"), "--questions", str(n),
                   "--side-out", str(Path(tmp) / "reference.json")] + (["--only", *only] if only else [])  # fmt: skip
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
            return json.loads((Path(tmp) / "reference.json").read_text())
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False, capture_output=True)


def compare(reference: dict, ours: dict) -> dict:
    rows, total_ref, total_ours = {}, 0.0, 0.0
    for unit, ref in reference["units"].items():
        new = ours["units"][unit]
        n = min(len(ref["answers"]), len(new["answers"]))
        total_ref, total_ours = total_ref + ref["seconds"], total_ours + new["seconds"]
        rows[unit] = {
            "reference_s_per_question": ref["seconds"] / n, "ours_s_per_question": new["seconds"] / n,
            "speedup": ref["seconds"] / new["seconds"], "same_answers": sum(a == b for a, b in zip(ref["answers"], new["answers"])),
            "same_traces": sum(a == b for a, b in zip(ref["traces"], new["traces"])),
            "same_answers_after": sum(a == b for a, b in zip(ref["after"], new["after"])), "questions": n,
            "different": [i for i, (a, b, c, d) in enumerate(zip(ref["answers"], new["answers"], ref["traces"], new["traces"])) if a != b or c != d],
        }  # fmt: skip
    return {"units": rows, "reference_s": total_ref, "ours_s": total_ours, "speedup": total_ref / total_ours}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=40, help="test questions (the first of rag_eval's sample)")
    parser.add_argument("--reference", default="19913cf", help="git commit of the reference loop")
    parser.add_argument("--only", nargs="*", help="configurations to run (default: all, and the sweep)")
    parser.add_argument("--batch-one", type=int, default=32, help="questions also answered one at a time by our loop (0: none)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="benchmarks/results/rag_speed_cpu.json")
    parser.add_argument("--side", choices=["reference", "ours"], help=argparse.SUPPRESS)  # one side, in this process
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        Path(args.side_out).write_text(json.dumps(run_side(args.side, args.params, args.questions, args.only)))
        return
    reference = reference_side(args.reference, args.questions, args.only)
    ours = run_side("ours", args.params, args.questions, args.only)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": ours["threads"]},
              "reference": args.reference, "questions": args.questions, **compare(reference, ours)}  # fmt: skip
    if args.batch_one:  # our loop one question at a time: the same answers and retrievals as batched
        one = compare(run_side("ours", args.params, args.batch_one, args.only, batch_size=1), ours)
        result["batch_one"] = {"questions": args.batch_one, **{unit: {k: row[k] for k in ("same_answers", "same_traces", "same_answers_after", "different")}
                                                              for unit, row in one["units"].items()}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for unit, row in result["units"].items():
        print(f"{unit:32s} {row['reference_s_per_question']:6.2f} -> {row['ours_s_per_question']:6.3f} s/question ({row['speedup']:5.1f}x), "
              f"same answers {row['same_answers']}/{row['questions']}, same retrievals {row['same_traces']}/{row['questions']}")  # fmt: skip
    print(f"total {result['reference_s']:.0f} s -> {result['ours_s']:.0f} s: {result['speedup']:.2f}x")
    for unit, row in result.get("batch_one", {}).items():
        if isinstance(row, dict):
            print(f"one at a time vs batched, {unit:32s} same answers {row['same_answers']}, same retrievals {row['same_traces']}")


if __name__ == "__main__":
    main()
