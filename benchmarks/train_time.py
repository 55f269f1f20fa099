"""Seconds of the training stages on the test suite's fixtures: ``train_early`` and ``train_realtime`` run as stages
(each in its own process, as DVC runs it, start-up included) on the tiny pipeline of ``tests/conftest.py`` (the
tiny Llama, the hand-made QA and article fixtures), and the utility trigger's training
(:func:`~detectors.utility.training.train_utility_detector`) on that pipeline's early set with planted utility labels
(the tiny Llama never learnt to read passages: ``build_utility`` gives it nothing to learn).

What it measures: how much the trainers' own work (several seeds, candidates, the choice) costs beside each other on
the same machine; a fixture's seconds are mostly Lightning's per-fit overhead. Each stage runs ``--repeats`` times;
the medians of the wall and of the stage process's CPU seconds (all its threads: less sensitive to other jobs on the
machine) are reported with the machine, its load and the seeds per detector.

Run: ``python -m benchmarks.train_time [--repeats 3] [--out benchmarks/results/train_time_cpu.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]


def utility_rows(early: pd.DataFrame) -> pd.DataFrame:
    """The early set's ok rows with planted utility labels and post-retrieval columns (the early ones, shifted for the
    questions retrieval helps), in the shape :func:`~detectors.utility.training.joined` gives."""
    from detectors.utility.labels import HELPS, HURTS, NEITHER

    ok = early[early["status"] == "ok"].reset_index(drop=True)
    wrong, every = ok["label"].to_numpy(bool), np.arange(len(ok))
    helps, hurts = wrong & (every % 3 != 0), ~wrong & (every % 2 == 0)
    utility = np.where(helps, HELPS, np.where(hurts, HURTS, NEITHER))
    shift = np.where(helps, 0.2, -0.1)
    return ok.assign(
        utility=utility,
        correct_without=~wrong,
        correct_with=np.where(helps, True, np.where(hurts, False, ~wrong)),
        post_first_token_prob=np.clip(ok["first_token_prob"] + shift, 0, 1),
        post_first_token_entropy=ok["first_token_entropy"],
        post_first_token_margin=ok["first_token_margin"],
        post_hidden=[list(np.asarray(h) + s) for h, s in zip(ok["hidden"], shift)],
        retrieval_scores=[[2.0 + s, 1.0] for s in shift],
    )


def run_stage(name: str) -> tuple[float, float]:
    """Stage ``name`` as DVC runs it (``python -m pipelines.<name>`` in its own process, start-up included) in the
    current directory: its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    command = [sys.executable, "-m", f"pipelines.{name}", "--params", "params.yaml"]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/train_time_cpu.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_llama, build_tokenizer, write_params

    from detectors.config.core import from_dict
    from detectors.config.schema import EarlyFeatureParams, TrainingParams
    from detectors.llm.loading import prepared_reference
    from detectors.utility.training import train_utility_detector

    seconds: dict[str, list[float]] = {"train_early": [], "train_realtime": [], "train_utility": []}
    cpu: dict[str, list[float]] = {name: [] for name in seconds}
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        tokenizer = build_tokenizer()
        checkpoint = Path(tmp) / "tiny-llama"
        build_tiny_llama(tokenizer).save_pretrained(checkpoint, safe_serialization=True)
        tokenizer.save_pretrained(checkpoint)
        write_params(Path(tmp), checkpoint)
        shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
        raw = yaml.safe_load(Path("params.yaml").read_text())
        for section in ("train_early", "train_realtime", "train_utility"):  # the shipped seeds, not the tests' fewer
            if "seeds" in shipped[section]["training"]:
                raw[section]["training"]["seeds"] = shipped[section]["training"]["seeds"]
        Path("params.yaml").write_text(yaml.safe_dump(raw))
        for stage in ("prepare", "prepare_articles", "build_early", "build_realtime"):
            run_stage(stage)
        utility = dict(raw["train_early"]["training"])  # the tests' sizes, with the utility trigger's own seeds
        utility.pop("seeds", None)
        utility |= {k: v for k, v in raw["train_utility"]["training"].items() if k == "seeds"}
        training = from_dict(TrainingParams, utility, "train_utility.training")
        features = from_dict(EarlyFeatureParams, raw["build_early"]["features"], "build_early.features")
        rows = utility_rows(pd.read_parquet("data/early/early.parquet"))
        fingerprint, llm_ref = prepared_reference("data/llm")
        for _ in range(args.repeats):
            for name in ("train_early", "train_realtime"):
                wall, used = run_stage(name)
                seconds[name].append(wall)
                cpu[name].append(used)
            start, start_cpu = time.perf_counter(), time.process_time()
            train_utility_detector(
                rows,
                "facts",
                ["first_token", "hidden"],
                training,
                0.6,
                2,
                features,
                fingerprint,
                llm_ref,
                "utility-facts",
            )
            seconds["train_utility"].append(time.perf_counter() - start)
            cpu["train_utility"].append(time.process_time() - start_cpu)
        seeds = {s: raw[s]["training"].get("seeds", 1) for s in ("train_early", "train_realtime", "train_utility")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "commit": commit.stdout.strip(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": os.getloadavg()[0],
        "seeds": seeds,
        "median_seconds": {k: round(statistics.median(v), 1) for k, v in seconds.items()},
        "median_cpu_seconds": {k: round(statistics.median(v), 1) for k, v in cpu.items()},
        "seconds": {k: [round(x, 1) for x in v] for k, v in seconds.items()},
        "cpu_seconds": {k: [round(x, 1) for x in v] for k, v in cpu.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
