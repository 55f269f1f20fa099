"""What the LLM's dtype changes: two whole pipeline runs of the same commit, one in float32 and one in the default dtype
(bfloat16 on a CPU with native bf16), compared result by result.

What it reports
---------------
* **the early set**: how many greedy answers and labels are the same, and the agreement of the IG attributions on the
  same questions (Spearman correlation of each question's attribution, correlation and mean difference of the
  attribution entropy, DioR's Eq. 1);
* **every comparison row** (``data/eval/comparison.parquet``): test AUROC in both runs; for the early (question)
  scorers the paired difference on the same questions (a bootstrap over the questions, each run with its own labels);
  the real-time sets differ (other continuations, other entities), so their rows are side by side with their own
  intervals;
* **every RAG accuracy** (``data/metrics/rag_eval.json`` and the stored runs): accuracy in both runs, the paired
  difference on the same questions with a bootstrap interval, and how many questions changed correctness.

Run: ``python -m benchmarks.dtype_effect --float32 RUN_DIR --default RUN_DIR
[--out benchmarks/results/dtype_effect_cpu.json]`` (each RUN_DIR a checkout where ``dvc repro`` ran; the float32 one
with ``llm.dtype: float32``; a float32 run that stopped before ``rag_eval``, ``dvc repro evaluate``, gives the early set
and the comparison rows only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from detectors.config.rag import RESERVED
from detectors.evaluation.answer_metrics import accuracy
from detectors.evaluation.bootstrap import paired_bootstrap_delta, paired_mean_delta


def lines(run: Path, corpus: str, name: str) -> pd.DataFrame:
    """The stored answers of one run (one row per question: id, answer)."""
    frame = pd.concat(
        [pd.read_parquet(p) for p in sorted((run / "data/rag/runs" / corpus / name).glob("shard-*.parquet"))]
    )
    return frame.assign(answer=[json.loads(x)["answer"] for x in frame["line"]])[["id", "answer"]]


def early_set(a: Path, b: Path) -> dict:
    cols = ["id", "status", "answer", "label", "attribution", "entropy"]
    x, y = (pd.read_parquet(r / "data/early/early.parquet", columns=cols) for r in (a, b))
    both = x.merge(y, on="id", suffixes=("_f", "_d"))
    both = both[(both["status_f"] == "ok") & (both["status_d"] == "ok")]
    rho = [
        spearmanr(p, q).statistic
        for p, q in zip(both["attribution_f"], both["attribution_d"])
        if len(p) > 2 and len(p) == len(q)
    ]
    ent = both[["entropy_f", "entropy_d"]].to_numpy(dtype=float)
    return {
        "questions": len(both),
        "same_answer": int((both["answer_f"] == both["answer_d"]).sum()),
        "same_label": int((both["label_f"] == both["label_d"]).sum()),
        "attribution_spearman_median": float(np.nanmedian(rho)),
        "attribution_spearman_p10": float(np.nanpercentile(rho, 10)),
        "entropy_correlation": float(np.corrcoef(ent.T)[0, 1]),
        "entropy_mean_abs_diff": float(np.abs(ent[:, 0] - ent[:, 1]).mean()),
        "entropy_sd": float(ent[:, 0].std()),
    }


def comparison(a: Path, b: Path) -> list[dict]:
    x, y = (pd.read_parquet(r / "data/eval/comparison.parquet") for r in (a, b))
    keys = ["dataset", "level", "scorer"]
    rows = x.merge(y, on=keys, suffixes=("_f", "_d"))
    early = {r: pd.read_parquet(r / "data/eval/early_scores.parquet") for r in (a, b)}
    out = []
    for _, r in rows.iterrows():
        row = {k: r[k] for k in keys} | {
            "auroc_float32": r["auroc_f"],
            "ci_float32": [r["auroc_ci_low_f"], r["auroc_ci_high_f"]],
            "auroc_default": r["auroc_d"],
            "ci_default": [r["auroc_ci_low_d"], r["auroc_ci_high_d"]],
        }
        if r["dataset"] == "early" and r["scorer"] in early[a].columns and r["scorer"] in early[b].columns:
            f, d = (early[run][early[run]["split"] == "test"][["id", "label", r["scorer"]]].dropna() for run in (a, b))
            m = f.merge(d, on="id", suffixes=("_f", "_d"))
            lf, ld = m["label_f"].to_numpy(int), m["label_d"].to_numpy(int)
            # as the comparison ranked them
            sf, sd = (
                m[f"{r['scorer']}_f"].to_numpy(float),
                m[f"{r['scorer']}_d"].to_numpy(float),
            )
            # the same resampled questions, each run's labels
            delta, low, high = paired_bootstrap_delta(ld, sd, sf, reference_labels=lf)
            row |= {"paired_questions": len(m), "delta_auroc": delta, "delta_ci": [low, high]}
        out.append(row)
    return out


def rag(a: Path, b: Path) -> list[dict]:
    if not all((r / "data/metrics/rag_eval.json").exists() for r in (a, b)):  # a run that stopped before rag_eval
        return []
    x, y = (json.loads((r / "data/metrics/rag_eval.json").read_text()) for r in (a, b))
    qa = pd.read_parquet(a / "data/prepared/qa.parquet", columns=["id", "answers"]).set_index("id")["answers"]
    out = []
    for corpus in [c for c in x if c in y and isinstance(x[c], dict) and c not in RESERVED]:
        for name in x[corpus]:
            row = {
                "corpus": corpus,
                "configuration": name,
                "accuracy_float32": x[corpus][name]["accuracy"],
                "accuracy_default": y[corpus][name]["accuracy"],
                "retrievals_float32": x[corpus][name].get("retrievals_per_question"),
                "retrievals_default": y[corpus][name].get("retrievals_per_question"),
            }
            run = corpus if (a / "data/rag/runs" / corpus / name).exists() else next(iter(x))
            try:
                f, d = lines(a, run, name), lines(b, run, name)
            except ValueError:  # no stored shards (a configuration run on another corpus only)
                out.append(row)
                continue
            m = f.merge(d, on="id", suffixes=("_f", "_d"))
            # the table's containment
            cf = np.array([accuracy(p, list(qa[i])) for i, p in zip(m["id"], m["answer_f"])], dtype=float)
            cd = np.array([accuracy(p, list(qa[i])) for i, p in zip(m["id"], m["answer_d"])], dtype=float)
            delta, low, high = paired_mean_delta(cd, cf)
            row |= {
                "paired_questions": len(m),
                "delta": delta,
                "delta_ci": [low, high],
                "changed_correctness": int((cd != cf).sum()),
                "same_answer": int((m["answer_f"] == m["answer_d"]).sum()),
            }
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--float32", required=True, type=Path)
    parser.add_argument("--default", required=True, type=Path)
    parser.add_argument("--out", default="benchmarks/results/dtype_effect_cpu.json")
    args = parser.parse_args(argv)
    result = {
        "float32": str(args.float32),
        "default": str(args.default),
        "early_set": early_set(args.float32, args.default),
        "comparison": comparison(args.float32, args.default),
        "rag": rag(args.float32, args.default),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=float) + "\n")
    e = result["early_set"]
    print(
        f"early set: {e['same_answer']}/{e['questions']} same answers, {e['same_label']} same labels; "
        "IG Spearman median "
        f"{e['attribution_spearman_median']:.3f}, entropy r = {e['entropy_correlation']:.3f}"
    )
    for r in result["comparison"]:
        extra = (
            f"  paired Δ {r['delta_auroc']:+.3f} [{r['delta_ci'][0]:+.3f}, {r['delta_ci'][1]:+.3f}]"
            if "delta_auroc" in r
            else ""
        )
        print(
            f"{r['dataset']:8s} {r['level']:12s} {r['scorer']:38s} "
            f"{r['auroc_float32']:.3f} -> {r['auroc_default']:.3f}{extra}"
        )
    for r in result["rag"]:
        extra = (
            (
                f"  paired Δ {r['delta']:+.3f} [{r['delta_ci'][0]:+.3f}, {r['delta_ci'][1]:+.3f}], "
                f"{r['changed_correctness']} changed"
            )
            if "delta" in r
            else ""
        )
        print(
            f"{r['corpus']:6s} {r['configuration']:14s} "
            f"{r['accuracy_float32']:.3f} -> {r['accuracy_default']:.3f}{extra}"
        )


if __name__ == "__main__":
    main()
