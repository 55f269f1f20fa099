"""Do the trained detectors' headline rows, and the RAG operating points chosen with them, survive another training
seed? (issue 47, item 7 and its target)

In a project where the pipeline ran, the training stages are run again with other first seeds, the sets built once:
each training is a copy of the checkout (its DVC cache shared) whose ``train_early``, ``train_realtime`` and
``train_utility`` seeds are moved, then ``dvc repro evaluate`` (the training stages and the comparison; nothing
upstream reruns). The run's own training is the first column. Written: ``docs/results/stability.md`` and
``benchmarks/results/stability_cpu.json``: every trained detector's test AUROC and interval in each training, the
spread (max - min) beside half the narrowest interval's width (the issue's target: the spread below it), and the
real-time candidate each training registered. The checkout itself is read, never changed.

With ``--rag`` each copy also registers its detectors (``dvc repro register``, and ``register_ctrla`` into the copy's
own MLflow store) and runs the RAG evaluation there (``dvc repro rag_eval``: each configuration's operating point
chosen on the validation questions with that training's detectors, then the test questions answered). The copy starts
from the run's finished RAG runs, so only runs that read a registered detector compute again. The page then shows
each configuration's operating point in every training with the candidates the rule called ties, and every paired
difference of the RAG table (each row against no retrieval, always retrieving and the row it is set ``versus``) whose
verdict (above, level with, below: what a README claim may say) changes between trainings.

Run: ``python -m benchmarks.stability --checkout /path/to/built/clone [--seeds 100 200] [--rag]`` (about 15 min a
seed on a 2-core CPU at the default params; with ``--rag`` about an hour more).
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
from typing import Any

import pandas as pd
import yaml

SECTIONS = ("train_early", "train_realtime", "train_utility")
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


def operating_points(metrics: dict) -> dict:
    """``{corpus: {configuration: {"chosen", "ties"}}}`` of a ``rag_eval`` metrics file's (or
    :func:`choose_operating_points`') tuning: the label of the candidate each configuration runs at, and the
    candidates the rule found level with it."""
    return {
        corpus: {name: {"chosen": t["choice"]["chosen"], "ties": t["choice"]["ties"]} for name, t in tuned.items()}
        for corpus, tuned in metrics["tuning"].items()
    }


COMPARISONS = ("never", "always", "versus")  # the paired differences a RAG row's claims rest on


def rag_rows(metrics: dict) -> dict[str, dict]:
    """``{"<corpus> · <configuration>": {"accuracy": a, "<reference>": [delta, low, high], ...}}`` of a ``rag_eval``
    metrics file: each row's test accuracy and its paired differences to no retrieval, always retrieving and the row it
    is set ``versus``."""
    out = {}
    for corpus in metrics["thresholds"]:
        for name, m in metrics[corpus].items():
            row: dict[str, Any] = {"accuracy": m["accuracy"]}
            for ref in COMPARISONS:
                key = f"accuracy_vs_{ref}"
                if m.get(key) is not None:
                    row[ref] = [m[key], m[f"{key}_ci_low"], m[f"{key}_ci_high"]]
            out[f"{corpus} · {name}"] = row
    return out


def verdict(delta: list[float]) -> str:
    """What a paired difference lets a claim say: above (its interval above 0), below, or level with."""
    return "above" if delta[1] > 0 else "below" if delta[2] < 0 else "level with"


def measured(trainings: dict[str, dict], key: str) -> tuple[list[str], dict]:
    """The trainings that measured ``key`` and the first one's measurement ({} when none did)."""
    names = [n for n, t in trainings.items() if key in t]
    return names, trainings[names[0]][key] if names else {}


def claim_stability(trainings: dict[str, dict]) -> list[dict]:
    """Per RAG test row and comparison present in every training: each training's difference and verdict, and
    whether the verdict is the same in all (a README claim on it cannot change sign)."""
    names, first = measured(trainings, "rag_rows")
    if not names:
        return []
    out = []
    for row, values in first.items():
        for ref in COMPARISONS:
            deltas = [trainings[n]["rag_rows"].get(row, {}).get(ref) for n in names]
            if ref not in values or any(d is None for d in deltas):
                continue
            verdicts = [verdict(d) for d in deltas]
            out.append(
                {
                    "row": row,
                    "versus": ref,
                    "delta": dict(zip(names, deltas)),
                    "verdict": dict(zip(names, verdicts)),
                    "same": len(set(verdicts)) == 1,
                    "moved": len({tuple(d) for d in deltas}) > 1,
                }
            )
    return out


def retrain(checkout: Path, seed: int, work: Path, rag: bool = False) -> dict:
    """Copy ``checkout`` into ``work``, move its training seeds to ``seed`` and rerun the comparison there (a copy
    left by a stopped run is resumed); with ``rag``, register the detectors there and choose the RAG operating points
    on the validation questions and answer the test questions there (``dvc repro rag_eval``: the copy's own code, its
    finished runs resumed)."""
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
    result = training(clone)
    if rag:
        print(f"seed {seed}: registering and running the RAG evaluation in {clone}", flush=True)
        subprocess.run(["dvc", "repro", "register"], **run)
        if not _registered(clone, "ctrla-honesty"):  # its directions are not seeded: registered as they are
            subprocess.run(["dvc", "repro", "--single-item", "--force", "register_ctrla"], **run)
        subprocess.run(["dvc", "repro", "rag_eval"], **run)
        metrics = json.loads((clone / rag_metrics_path(clone)).read_text())
        result["operating_points"], result["rag_rows"] = operating_points(metrics), rag_rows(metrics)
    return result


def rag_metrics_path(checkout: Path) -> str:
    """Where a checkout's ``rag_eval`` writes its metrics (``paths.rag_metrics``)."""
    return yaml.safe_load((checkout / "params.yaml").read_text())["paths"]["rag_metrics"]


def _registered(clone: Path, name: str) -> bool:
    """Whether the copy's own MLflow store holds a registered model ``name``."""
    import sqlite3

    db = clone / "data/mlflow/mlflow.db"
    if not db.exists():
        return False
    with sqlite3.connect(db) as con:
        return bool(con.execute("select 1 from registered_models where name = ?", (name,)).fetchone())


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


def point_stability(trainings: dict[str, dict]) -> list[dict]:
    """Per corpus and configuration with a point to choose: the candidate each training chose, whether all chose the
    same, and the candidates the rule called level with the chosen one in any training."""
    names, first = measured(trainings, "operating_points")
    if not names:
        return []
    out = []
    for corpus, configurations in first.items():
        for name in configurations:
            points = [trainings[n]["operating_points"].get(corpus, {}).get(name) for n in names]
            chosen = {n: p["chosen"] if p else None for n, p in zip(names, points)}
            ties = sorted({t for p in points if p for t in p["ties"]})
            out.append(
                {
                    "corpus": corpus,
                    "configuration": name,
                    "chosen": chosen,
                    "same": len(set(chosen.values())) == 1,
                    "ties": ties,
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
    points = result.get("operating_points") or []
    if points:
        named = list(points[0]["chosen"])
        lines += [
            "## RAG operating points",
            "",
            "Each configuration's operating point as the RAG evaluation's validation half chose it with each",
            "training's registered detectors (the validation sweeps, every candidate on the validation questions, the",
            "rule of choices; no test question read): the default (never retrieving, or always when surely better)",
            "unless a candidate beats it by a paired interval above 0. *Level with* lists the candidates the rule",
            "found level with the chosen one in any training: a choice that differs between trainings is stable only",
            "as one of those ties.",
            "",
            "| corpus | configuration | " + " | ".join(named) + " | same | level with |",
            "| --- | --- | " + " | ".join("---" for _ in named) + " | --- | --- |",
        ]
        for p in points:
            cells = " | ".join(f"`{p['chosen'][n]}`" for n in named)
            ties = ", ".join(f"`{t}`" for t in p["ties"]) or "none"
            lines.append(
                f"| {p['corpus']} | {p['configuration']} | {cells} | {'yes' if p['same'] else '**no**'} | {ties} |"
            )
        same = sum(p["same"] for p in points)
        lines += ["", f"The same operating point in every training: {same} of {len(points)}.", ""]
    claims = result.get("claims") or []
    if claims:
        named = list(claims[0]["verdict"])
        moved = [c for c in claims if c["moved"]]
        lines += [
            "## RAG test rows",
            "",
            "Every paired difference of the RAG table (a row's accuracy minus no retrieval's, always retrieving's and",
            "the row's it is set `versus`, 95 % intervals over the test questions) in each training, with its",
            "verdict: above (interval above 0), below, or level with. A README claim rests on a verdict. The",
            "differences that moved with the training:",
            "",
            "| row | versus | " + " | ".join(named) + " | same verdict |",
            "| --- | --- | " + " | ".join("---" for _ in named) + " | --- |",
        ]
        for c in moved:
            cells = " | ".join(
                f"{c['delta'][n][0]:+.3f} [{c['delta'][n][1]:+.3f}, {c['delta'][n][2]:+.3f}] {c['verdict'][n]}"
                for n in named
            )
            lines.append(f"| {c['row']} | {c['versus']} | {cells} | {'yes' if c['same'] else '**no**'} |")
        same = sum(c["same"] for c in claims)
        lines += [
            "",
            f"Differences that moved: {len(moved)} of {len(claims)} (the others are identical in every training). The",
            f"same verdict in every training: {same} of {len(claims)}.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, type=Path, help="a clone where `make repro` ran")
    parser.add_argument("--seeds", type=int, nargs="+", default=[100, 200], help="first seeds of the other trainings")
    parser.add_argument("--work", type=Path, default=None, help="where the clones go (default: a temporary dir)")
    parser.add_argument("--rag", action="store_true", help="also choose the RAG operating points in each training")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    seed = yaml.safe_load((checkout / "params.yaml").read_text())["train_early"]["training"]["seed"]
    trainings = {f"seed {seed} (the run)": training(checkout)}
    if args.rag:
        metrics = json.loads((checkout / rag_metrics_path(checkout)).read_text())
        trainings[f"seed {seed} (the run)"] |= {
            "operating_points": operating_points(metrics),
            "rag_rows": rag_rows(metrics),
        }
    work = args.work or Path(tempfile.mkdtemp(prefix="stability-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    for s in args.seeds:  # the page is written after each training, so a stopped run keeps what it measured
        trainings[f"seed {s}"] = retrain(checkout, s, work, args.rag)
        result = {
            "commit": commit.stdout.strip(),
            "trainings": trainings,
            "rows": spread(trainings),
            "operating_points": point_stability(trainings),
            "claims": claim_stability(trainings),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.page.write_text(markdown(result))
        print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
