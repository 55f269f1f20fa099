"""Do the trained detectors' headline rows survive another training seed? (issue 47, item 7)

In a project where the pipeline ran, the training stages are run again with other first seeds, the sets built once:
each training is a copy of the checkout (its DVC cache shared) whose ``train_early`` and
``train_realtime`` seeds are moved, then ``dvc repro evaluate`` (the two training stages and the comparison; nothing
upstream reruns). The run's own training is the first column. Written: ``docs/results/stability.md`` and
``benchmarks/results/stability_cpu.json``: every trained detector's test AUROC and interval in each training, the
spread (max - min) beside half the narrowest interval's width (the issue's target: the spread below it), and the
real-time candidate each training registered. The checkout itself is read, never changed.

Run: ``python -m benchmarks.stability --checkout /path/to/built/clone [--seeds 100 200]`` (about 15 min a seed on
a 2-core CPU at the default params).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pandas as pd
import yaml

SECTIONS = ("train_early", "train_realtime")
PAGE = Path("docs/results/stability.md")
OUT = Path("benchmarks/results/stability_cpu.json")


def with_seed(params: str, seed: int) -> str:
    """``params.yaml``'s text with ``training.seed`` of each of :data:`SECTIONS` set to ``seed``."""
    for section in SECTIONS:
        pattern = re.compile(rf"(^{section}:.*\n(?:(?:[ #].*)?\n)*?    seed: )\d+", re.MULTILINE)
        params, n = pattern.subn(rf"\g<1>{seed}", params, count=1)
        if n != 1:
            raise SystemExit(f"params.yaml: no {section}.training.seed to set")
    return params


def training(checkout: Path) -> dict:
    """The trained detectors' test rows of a built checkout and the real-time candidate it registered."""
    table = pd.read_parquet(checkout / "data/eval/comparison.parquet")
    rows = table[table["kind"] != "baseline"]
    realtime = json.loads((checkout / "data/metrics/train_realtime.json").read_text())["mlp"]
    return {
        "rows": {
            f"{r.dataset} · {r.level} · {r.scorer}": [r.auroc, r.auroc_ci_low, r.auroc_ci_high]
            for r in rows.itertuples()
        },
        "realtime_candidate": realtime.get("tokens"),
        "realtime_choice": realtime.get("choice"),
    }


def copy(path: Path, target: Path) -> None:
    """``path`` (a file, a link or a directory) copied over ``target``."""
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()
    if path.is_dir() and not path.is_symlink():
        shutil.copytree(path, target, symlinks=True)
    else:
        shutil.copy2(path, target, follow_symlinks=False)


def retrain(checkout: Path, seed: int, work: Path) -> dict:
    """Copy ``checkout`` into ``work``, move its training seeds to ``seed`` and rerun the comparison there (a copy
    left by a stopped run is resumed)."""
    clone = work / f"seed-{seed}"
    env = {**os.environ, "PATH": f"{checkout / '.venv/bin'}:{os.environ['PATH']}"}
    run = dict(cwd=clone, env=env, check=True)
    if not (clone / ".dvc").is_dir():  # a copy made before (a stopped run) is resumed: dvc reruns what is missing
        subprocess.run(["git", "clone", "-q", str(checkout), str(clone)], check=True)
        skip = {".git", ".venv", ".dvc"}  # the workspace as the run left it (outputs, metrics, params, dvc.lock)
        for path in checkout.iterdir():
            if path.name not in skip and path.name != "data":
                copy(path, clone / path.name)
        for path in (checkout / "data").iterdir():  # the MLflow store left out: its own (the run's may be in use)
            if path.name != "mlflow":
                copy(path, clone / "data" / path.name)
        subprocess.run(["dvc", "cache", "dir", "--local", str(checkout / ".dvc/cache")], **run)
        (clone / "params.yaml").write_text(with_seed((clone / "params.yaml").read_text(), seed))
    print(f"seed {seed}: dvc repro evaluate in {clone}", flush=True)
    subprocess.run(["dvc", "repro", "evaluate"], **run)
    return training(clone)


def spread(trainings: dict[str, dict]) -> list[dict]:
    """Per row: each training's AUROC, the spread, and half the narrowest interval's width."""
    names = list(trainings)
    keys = [k for k in trainings[names[0]]["rows"] if all(k in t["rows"] for t in trainings.values())]
    out = []
    for key in keys:
        values = [trainings[n]["rows"][key] for n in names]
        aurocs = [v[0] for v in values]
        half = min((hi - lo) / 2 for _, lo, hi in values)
        out.append(
            {
                "row": key,
                "auroc": dict(zip(names, aurocs)),
                "spread": max(aurocs) - min(aurocs),
                "half_interval": half,
                "stable": max(aurocs) - min(aurocs) < half,
            }
        )
    return out


def markdown(result: dict) -> str:
    names = list(result["trainings"])
    lines = [
        "# Stability across training seeds",
        "",
        "Written by `python -m benchmarks.stability` (issue 47, item 7), never by hand: the trained detectors' test",
        f"rows from {len(names)} trainings of the same sets (commit `{result['commit']}`), each a seed ensemble of",
        "`training.seeds` nets whose first seed is the column's. A row is stable when its spread (max − min) is below",
        "half the width of its narrowest 95 % interval.",
        "",
        "| detector row (dataset · level · scorer) | " + " | ".join(names) + " | spread | half interval | stable |",
        "| --- | " + " | ".join("---" for _ in names) + " | --- | --- | --- |",
    ]
    for row in result["rows"]:
        cells = " | ".join(f"{row['auroc'][n]:.3f}" for n in names)
        lines.append(
            f"| {row['row']} | {cells} | {row['spread']:.3f} | {row['half_interval']:.3f} | "
            f"{'yes' if row['stable'] else '**no**'} |"
        )
    lines += [
        "",
        "The real-time candidate each training registered (kept unless another beats it by a paired interval above 0):",
        "",
        "| training | candidate |",
        "| --- | --- |",
        *(f"| {n} | `{t['realtime_candidate']}` |" for n, t in result["trainings"].items()),
        "",
        f"Stable rows: {sum(r['stable'] for r in result['rows'])} of {len(result['rows'])}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, type=Path, help="a clone where `make repro` ran")
    parser.add_argument("--seeds", type=int, nargs="+", default=[100, 200], help="first seeds of the other trainings")
    parser.add_argument("--work", type=Path, default=None, help="where the clones go (default: a temporary dir)")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    seed = yaml.safe_load((checkout / "params.yaml").read_text())["train_early"]["training"]["seed"]
    trainings = {f"seed {seed} (the run)": training(checkout)}
    work = args.work or Path(tempfile.mkdtemp(prefix="stability-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    for s in args.seeds:  # the page is written after each training, so a stopped run keeps what it measured
        trainings[f"seed {s}"] = retrain(checkout, s, work)
        result = {
            "commit": commit.stdout.strip(),
            "trainings": trainings,
            "rows": spread(trainings),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.page.write_text(markdown(result))
        print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
