"""Throughput of the build_early stage vs the number of Ray workers, and what the merge costs.

Runs the real stage (``python -m pipelines.build_early`` in its own process, as DVC does, start-up included: shards,
resume key, workers writing shards, the merge into one parquet) on the first ``--questions`` questions of
``paths.qa``, in shards of ``--shard-size``, once with the
``local`` backend and once per ``--workers`` count with the ``ray`` backend (a Ray of its own started for each run,
as ``execution.address: null`` does). Per run it reports the stage's wall time, questions/s, the speed-up over
``local`` and over one Ray worker, and the merge (reading every shard and writing the stage's parquet, timed again
apart on the finished shards). ``ray_overhead_s`` is the wall time of one Ray worker holding the local run's resources
(``ray-1-whole``: all of its CPU threads, the whole GPU) minus the local one's: Ray's start, the actor's start and
the per-shard hand-offs. Every run's parquet is compared with the local one
(answers, labels and statuses identical; the largest float difference: a worker's torch threads may differ from
the local run's, which changes CPU float reductions in the last bits).

``--random-shape`` builds a random-weight LLM of that shape (``benchmarks.throughput.SHAPES``) with the tokenizer of
``paths.llm`` and prepares it as a checkpoint in the scratch directory (no download: the GPU machine has none of
the LLM's weights). On one GPU, ``--gpus-per-worker 0.5`` puts two actors on it.

Run: ``python -m benchmarks.scaling [--questions 128] [--workers 1 2] [--random-shape smollm2-135m --device cuda
--gpus-per-worker 0.5]`` after the prepare stage; timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

from detectors.io import write_json
from detectors.llm.loading import prepare_llm
from detectors.shards import ShardStore


def random_checkpoint(shape: str, tokenizer_dir: str, out: Path) -> str:
    """A prepared LLM directory for a random-weight model of ``shape`` (saved in float32, loaded in ``llm.dtype``)."""
    from transformers import AutoTokenizer

    from benchmarks.throughput import random_llm

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    llm = random_llm(shape, tokenizer, "cpu", torch.float32)
    llm.model.generation_config.eos_token_id = tokenizer.eos_token_id
    llm.model.save_pretrained(out / "checkpoint")
    tokenizer.save_pretrained(out / "checkpoint")
    prepare_llm(str(out / "checkpoint"), out / "prepared")
    return str(out / "prepared")


def run_stage(base: dict, scratch: Path, name: str, execution: dict) -> tuple[float, float, pd.DataFrame]:
    """Wall time of build_early with ``execution``, the merge's time, and the stage's table."""
    params = json.loads(json.dumps(base))
    run_dir = scratch / name
    params["paths"].update(
        early_shards=str(run_dir / "shards"),
        early=str(run_dir / "early.parquet"),
        early_report=str(run_dir / "report.json"),
    )
    params["execution"] = execution
    path = scratch / f"{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipelines.build_early", "--params", str(path)], check=True)
    wall = time.perf_counter() - start
    n, size = len(pd.read_parquet(params["paths"]["qa"])), params["build_early"]["shard_size"]
    start = time.perf_counter()
    frame = ShardStore(
        run_dir / "shards", json.loads((run_dir / "shards/manifest.json").read_text())["config"]
    ).read_all(n, size)
    frame.to_parquet(run_dir / "merged.parquet", index=False)
    return wall, time.perf_counter() - start, pd.read_parquet(run_dir / "early.parquet")


def compare(frame: pd.DataFrame, reference: pd.DataFrame) -> dict:
    same = {c: bool(frame[c].astype(str).equals(reference[c].astype(str))) for c in ("id", "status", "answer", "label")}
    floats = 0.0
    for column in ("attribution", "entropy", "first_token_prob", "first_token_entropy", "first_token_margin", "hidden"):
        for a, b in zip(frame[column], reference[column]):
            if a is not None and b is not None:
                diff = np.abs(
                    np.asarray(np.stack(a) if np.ndim(a) and np.asarray(a).dtype == object else a, np.float64)
                    - np.asarray(np.stack(b) if np.ndim(b) and np.asarray(b).dtype == object else b, np.float64)
                )
                floats = max(floats, float(np.max(diff, initial=0.0)))
    return {"identical_ids_status_answers_labels": all(same.values()), "max_float_diff": floats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--questions", type=int, default=128)
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument(
        "--random-shape", default=None, help="a random-weight LLM of this shape instead of paths.llm's weights"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    base = yaml.safe_load(Path(args.params).read_text())
    device = (
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.random_shape:
            base["paths"]["llm"] = random_checkpoint(args.random_shape, base["paths"]["llm"], scratch / "llm")
        qa = pd.read_parquet(base["paths"]["qa"]).head(args.questions)
        qa.to_parquet(scratch / "qa.parquet", index=False)
        base["paths"]["qa"] = str(scratch / "qa.parquet")
        base["llm"]["device"] = device
        base["build_early"]["shard_size"] = args.shard_size
        ray_execution = {
            "backend": "ray",
            "address": None,
            "gpus_per_worker": args.gpus_per_worker,
            "cpus_per_worker": args.cpus_per_worker,
        }
        runs = {
            "local": (
                {"backend": "local", "address": None, "workers": 1, "gpus_per_worker": 0, "cpus_per_worker": 1},
                None,
            )
        }
        whole = {
            **ray_execution,
            "workers": 1,
            "cpus_per_worker": torch.get_num_threads(),
            "gpus_per_worker": 1 if device == "cuda" else 0,
        }
        runs["ray-1-whole"] = (whole, 1)  # the local run's resources in one actor: what Ray itself costs
        runs.update({f"ray-{n}": ({**ray_execution, "workers": n}, n) for n in args.workers})
        results, reference = {}, None
        for name, (execution, _) in runs.items():
            wall, merge, frame = run_stage(base, scratch, name, execution)
            reference = frame if reference is None else reference
            results[name] = {
                "wall_s": round(wall, 2),
                "questions_per_s": round(len(qa) / wall, 2),
                "merge_s": round(merge, 3),
                **compare(frame, reference),
            }
            print(name, results[name], flush=True)
    local = results["local"]["wall_s"]
    one = results.get("ray-1", {}).get("wall_s")
    for r in results.values():
        r["speedup_vs_local"] = round(local / r["wall_s"], 2)
        if one:
            r["speedup_vs_one_worker"] = round(one / r["wall_s"], 2)
    summary = {
        "machine": {
            "cpu_count": torch.get_num_threads(),
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        },
        "llm": args.random_shape or base["paths"]["llm"],
        "device": device,
        "questions": len(qa),
        "shard_size": args.shard_size,
        "gpus_per_worker": args.gpus_per_worker,
        "cpus_per_worker": args.cpus_per_worker,
        "runs": results,
        "ray_overhead_s": round(results["ray-1-whole"]["wall_s"] - local, 2),
    }
    print(json.dumps(summary, indent=2))
    out = args.out or f"benchmarks/results/scaling_{device}.json"
    write_json(out, summary)


if __name__ == "__main__":
    main()
