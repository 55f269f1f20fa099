"""Speed of the RAG evaluation: this checkout's loop and RetroRAG against an earlier commit's, on the same questions,
configurations, corpora, thresholds, LLM and registered detectors, in one run.

What it measures
----------------
For the first ``--questions`` validation questions (a measurement reads no test question: the test split is read
once, by the stages that write the results), every configuration of ``rag_eval`` over every
corpus (a configuration without triggers on the first corpus only, as the stage does), every framework (RetroRAG) and
the accuracy vs retrieval-rate sweep answer the questions on each side:

* **reference**: the code of ``--reference`` (a git commit, default ``183626a``: the last full run before the
  evaluation's new rules, whose validation sweeps took 5.6 min), checked out into a temporary git worktree and run in
  a child process, in the dtype it chose by default;
* **ours**: this checkout, in each dtype of ``--dtypes`` (default ``auto``, the new default, then ``float32``, the
  reference's, so that the answers can be compared with the same arithmetic).

Every side runs the configurations at the thresholds the last ``rag_eval`` chose (``paths.rag_metrics``; the sweep
alone, ``--only sweep``, needs none) and answers the configurations of a corpus one after another on the same
questions (as the stage's question-major shards do). Only the answering is timed
(loading the LLM, detectors and indexes is not). Reported per unit: seconds per question on each side and their ratio,
and how many answers and retrieval traces (trigger, position, queries, passages) are identical; overall, the ratio of
the total times. Timings are reported, never asserted. Run nothing else on the machine meanwhile: two processes whose
threads share the cores slow each other far more than twice.

A reference from before the seed ensembles (``183626a`` is one) cannot load the detectors registered now (its
``EarlyGRU`` takes no ``members``): there, only the configurations of training-free triggers compare (the sweep reads
every configuration's triggers).

Run: ``python -m benchmarks.rag_speed [--questions N] [--reference COMMIT] [--dtypes auto float32] [--out PATH]`` after
``dvc repro rag_eval``.
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


def trace(line: dict) -> list:
    """What must not change: the retrievals (trigger, position, queries, passages), as JSON stores them."""
    return json.loads(
        json.dumps([[r["trigger"], r["position"], r["queries"], r["passage_ids"]] for r in line.get("retrievals", [])])
    )


def systems(params):
    """The importable tree's RAG runtime as this benchmark drives it (``configuration``, ``framework``, ``sweep``
    returning systems with ``answer``): this layout's :class:`~detectors.rag.runtime.RagRuntime`, or, in a reference
    tree from before it moved into the library, the stage's runtime module behind an adapter (the one place a
    benchmark reads a stage module: older commits have nothing else)."""
    try:
        from detectors.rag.runtime import RagRuntime

        return RagRuntime(params)
    except ImportError:
        import importlib
        import types

        old = importlib.import_module("pipelines._rag_runtime").RagRuntime(params)
        first = lambda made: made[0] if isinstance(made, tuple) else made  # noqa: E731 - (answer, code[, kinds])
        rag = params["rag_eval"]

        def configuration(name, corpus, thresholds):
            return types.SimpleNamespace(answer=first(old.loop(name, rag.configurations[name], corpus, thresholds)))

        def framework(name, corpus):
            return types.SimpleNamespace(answer=first(old.framework(name, corpus)))

        def sweep(name, corpus, references):
            run = first(old.sweep_loop(corpus))
            return types.SimpleNamespace(answer=lambda qs, _: run(qs, [references[q] for q in qs]))

        return types.SimpleNamespace(llm=old.llm, configuration=configuration, framework=framework, sweep=sweep)


def run_side(side: str, params_path: str, n: int, dtype: str, only: list[str] | None) -> dict:
    """Answer the questions with the importable code (this checkout, or the reference worktree) in ``dtype``."""
    import dataclasses

    import pandas as pd
    import torch
    import yaml

    from detectors.config import StageParams, read_params

    reads = yaml.safe_load(Path(params_path).with_name("dvc.yaml").read_text())["stages"]["rag_eval"]["params"]
    p = StageParams(read_params(params_path), reads, "rag_eval")  # StageParams.of, in a tree from before it too
    object.__setattr__(p["llm"], "dtype", dtype) if dataclasses.is_dataclass(p["llm"]) else None
    rag = p["rag_eval"]
    qa = pd.read_parquet(p["paths.qa"])
    rows = qa[qa["split"] == "val"].reset_index(drop=True).head(n)  # the validation questions in the table's order
    questions, refs = list(rows["question"]), [list(a) for a in rows["answers"]]
    corpora = rag.corpora
    units = [
        (c, n_) for c in corpora for n_, config in rag.configurations.items() if config.triggers or c == corpora[0]
    ]
    units += [(c, f) for c in corpora for f in rag.frameworks] + [(rag.sweep.corpus, SWEEP)]
    units = [(c, n_) for c, n_ in units if not only or n_ in only]
    # read once, before the LLM loads, and only where a configuration runs at them
    thresholds = chosen(p) if any(n_ != SWEEP and n_ not in rag.frameworks for _, n_ in units) else {}
    runtime = systems(p)
    out = {
        "side": side,
        "dtype": runtime.llm.dtype_name,
        "threads": torch.get_num_threads(),
        "questions": len(questions),
        "units": {},
    }
    for corpus, name in units:
        if name == SWEEP:
            sweep = runtime.sweep(SWEEP, corpus, dict(zip(questions, refs)))
            start = time.perf_counter()
            lines = sweep.answer(questions, [False] * len(questions))
            answers = [{"answer": line["never_answer"], "retrievals": [], "after": line["answers"]} for line in lines]
        else:
            made = (
                runtime.framework(name, corpus)
                if name in rag.frameworks
                else runtime.configuration(name, corpus, own(thresholds[corpus], name))
            )
            start = time.perf_counter()
            answers = made.answer(questions, [False] * len(questions))
        seconds = time.perf_counter() - start
        out["units"][f"{corpus} · {name}"] = {
            "seconds": seconds,
            "answers": [a["answer"] for a in answers],
            "traces": [trace(a) for a in answers],
            "after": [a.get("after") for a in answers],
            "passes": [a.get("forward_passes") for a in answers],
        }
        print(f"{side} ({out['dtype']}): {corpus} · {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return out


def chosen(p) -> dict:
    """The thresholds the last ``rag_eval`` chose (``paths.rag_metrics``), which the configurations run at (the sweep
    needs none)."""
    metrics = Path(p["paths.rag_metrics"])
    if not metrics.exists():
        raise SystemExit(
            f"{metrics} is missing: run `dvc repro rag_eval` first (the configurations run at the thresholds it chose;"
            " `--only sweep` needs none)"
        )
    return json.loads(metrics.read_text())["thresholds"]


def own(thresholds: dict, name: str) -> dict[str, float]:
    """Configuration ``name``'s thresholds from the metrics file's ``thresholds`` of a corpus: per configuration since
    each runs its own tuning, by trigger in runs before that."""
    return thresholds.get(name, {}) if any(isinstance(v, dict) for v in thresholds.values()) else thresholds


def side_process(side: str, tree: Path, params: Path, n: int, dtype: str, only: list[str] | None, tmp: Path) -> dict:
    """One side in a child process with ``tree`` first on the path (its code), run from this checkout (its data)."""
    out = tmp / f"{side}-{dtype}.json"
    cmd = [
        sys.executable,
        str(Path(__file__)),
        "--side",
        side,
        "--params",
        str(params),
        "--questions",
        str(n),
        "--dtypes",
        dtype,
        "--side-out",
        str(out),
    ] + (["--only", *only] if only else [])
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(out.read_text())


def compare(reference: dict, ours: dict) -> dict:
    rows, total_ref, total_ours = {}, 0.0, 0.0
    for unit, ref in reference["units"].items():
        new = ours["units"][unit]
        n = min(len(ref["answers"]), len(new["answers"]))
        total_ref, total_ours = total_ref + ref["seconds"], total_ours + new["seconds"]
        rows[unit] = {
            "reference_s_per_question": ref["seconds"] / n,
            "ours_s_per_question": new["seconds"] / n,
            "speedup": ref["seconds"] / new["seconds"],
            "same_answers": sum(a == b for a, b in zip(ref["answers"], new["answers"])),
            "same_traces": sum(a == b for a, b in zip(ref["traces"], new["traces"])),
            "same_answers_after": sum(a == b for a, b in zip(ref["after"], new["after"])),
            "questions": n,
            "forward_passes_per_question": [
                sum(x or 0 for x in ref["passes"]) / n,
                sum(x or 0 for x in new["passes"]) / n,
            ],
        }
    return {
        "reference_dtype": reference["dtype"],
        "ours_dtype": ours["dtype"],
        "units": rows,
        "reference_s": total_ref,
        "ours_s": total_ours,
        "speedup": total_ref / total_ours,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--questions", type=int, default=32, help="validation questions (the first in the QA table's order)"
    )
    parser.add_argument("--reference", default="183626a", help="git commit of the reference code")
    parser.add_argument("--dtypes", nargs="+", default=["auto", "float32"], help="llm.dtype of our side, one run each")
    parser.add_argument("--only", nargs="*", help="configurations and frameworks to run (default: all, and the sweep)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="benchmarks/results/rag_speed_cpu.json")
    parser.add_argument("--side", choices=["reference", "ours"], help=argparse.SUPPRESS)  # one side, in this process
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        Path(args.side_out).write_text(
            json.dumps(run_side(args.side, args.params, args.questions, args.dtypes[0], args.only))
        )
        return
    with tempfile.TemporaryDirectory(prefix="rag-reference-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.reference],
            check=True,
            capture_output=True,
        )
        try:
            reference = side_process(
                "reference", tree, tree / "params.yaml", args.questions, "auto", args.only, Path(tmp)
            )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False, capture_output=True
            )
        ours = [
            side_process("ours", ROOT, ROOT / args.params, args.questions, dtype, args.only, Path(tmp))
            for dtype in args.dtypes
        ]
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": ours[0]["threads"],
        },
        "reference": args.reference,
        "questions": args.questions,
        "runs": [compare(reference, o) for o in ours],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for run in result["runs"]:
        print(f"reference ({run['reference_dtype']}) vs ours ({run['ours_dtype']})")
        for unit, row in run["units"].items():
            print(
                f"  {unit:28s} {row['reference_s_per_question']:6.3f} -> {row['ours_s_per_question']:6.3f} s/question "
                f"({row['speedup']:4.1f}x), "
                f"same answers {row['same_answers']}/{row['questions']}, "
                f"same retrievals {row['same_traces']}/{row['questions']}"
            )
        print(f"  total {run['reference_s']:.0f} s -> {run['ours_s']:.0f} s: {run['speedup']:.2f}x")


if __name__ == "__main__":
    main()
