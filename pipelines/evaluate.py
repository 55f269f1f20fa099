"""Stage evaluate: every detector and training-free score on the test split, the same way.

Writes dvc metrics (JSON), dvc plots (ROC and attribution-entropy ECDF, DioR Fig. 7) and one
MLflow run per scorer, nested under one comparison run, all with the same metric names.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from detectors import registry  # noqa: E402
from detectors.config import load_section  # noqa: E402
from detectors.early_detector import EarlyDetector  # noqa: E402
from detectors.metrics import binary_metrics, choose_threshold, platt, roc  # noqa: E402
from detectors.scorers import EARLY_BASELINES, DetectorScorer, LogisticScorer  # noqa: E402
from detectors.shards import write_json  # noqa: E402
from pipelines._stage import stage_params  # noqa: E402

log = logging.getLogger("evaluate")


def evaluate_scorers(frame: pd.DataFrame, scorers, strategy: str, ece_bins: int) -> tuple[dict, pd.DataFrame]:
    """Metrics per scorer on the test split (threshold and calibration from validation) and all scores."""
    ok = frame[frame["status"] == "ok"].reset_index(drop=True)
    val, test = ok[ok["split"] == "val"], ok[ok["split"] == "test"]
    scores = ok[["id", "split", "label"]].copy()
    results = {}
    for scorer in scorers:
        scores[scorer.name] = scorer.score(ok)
        s_val, s_test = scores.loc[val.index, scorer.name], scores.loc[test.index, scorer.name]
        threshold = scorer.detector.threshold if scorer.kind == "detector" else choose_threshold(val["label"], s_val, strategy)
        prob = s_test if scorer.is_probability else platt(val["label"], s_val)(s_test)
        results[scorer.name] = {"kind": scorer.kind, **binary_metrics(test["label"], s_test, threshold, prob, ece_bins)}
    return results, scores


def write_plots(scores: pd.DataFrame, frame: pd.DataFrame, results: dict, plots_dir: Path) -> list[Path]:
    """dvc plots (one CSV per curve, so each is its own series) and PNGs for MLflow."""
    roc_dir, ecdf_dir = plots_dir / "early_roc", plots_dir / "early_entropy_ecdf"
    for d in (roc_dir, ecdf_dir):
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("*.csv"):
            old.unlink()
    test = scores[scores["split"] == "test"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, metrics in results.items():
        fpr, tpr, _ = roc(test["label"], test[name])
        pd.DataFrame({"fpr": fpr, "tpr": tpr}).to_csv(roc_dir / f"{name}.csv", index=False)
        ax.plot(fpr, tpr, label=f"{name} ({metrics['auroc']:.3f})")
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="Early detection, test split")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots_dir / "early_roc.png", dpi=120)

    ok = frame[(frame["status"] == "ok") & (frame["split"] == "test")]
    fig2, ax2 = plt.subplots(figsize=(5.5, 4))
    for label, group in ok.groupby("label"):
        answer = "hallucinated" if label else "correct"
        values = np.sort(group["entropy"].to_numpy())
        ecdf = np.arange(1, len(values) + 1) / len(values)
        pd.DataFrame({"entropy": values, "ecdf": ecdf}).to_csv(ecdf_dir / f"{answer}.csv", index=False)
        ax2.step(values, ecdf, where="post", label=answer)
    ax2.set(xlabel="IG attribution entropy", ylabel="ECDF", title="Attribution entropy (DioR Fig. 7)")
    ax2.legend()
    fig2.tight_layout()
    fig2.savefig(plots_dir / "early_entropy_ecdf.png", dpi=120)
    plt.close("all")
    return [plots_dir / "early_roc.png", plots_dir / "early_entropy_ecdf.png"]


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    build, train = load_section("build_early", data=data), load_section("train_early", data=data)
    params, mlflow_params = load_section("evaluate", data=data), load_section("mlflow", data=data)
    frame = pd.read_parquet(build.out)
    model_dir = Path(train.out_dir)
    detectors = [DetectorScorer("gru", EarlyDetector.load(model_dir))]
    ablation_dir = model_dir / "ablation"
    detectors += [DetectorScorer(d.name, EarlyDetector.load(d)) for d in sorted(ablation_dir.iterdir())] if ablation_dir.exists() else []
    scorers = detectors + [LogisticScorer()] + list(EARLY_BASELINES)
    results, scores = evaluate_scorers(frame, scorers, train.threshold, params.ece_bins)
    Path(params.scores).parent.mkdir(parents=True, exist_ok=True)
    scores.to_parquet(params.scores, index=False)
    write_json(params.metrics, results)
    pngs = write_plots(scores, frame, results, Path(params.plots_dir))
    for name, m in sorted(results.items(), key=lambda kv: -kv[1]["auroc"]):
        log.info("%-45s AUROC %.3f  AUPRC %.3f  acc %.3f  F1 %.3f  ECE %.3f", name, m["auroc"], m["auprc"], m["accuracy"], m["f1"], m["ece"])

    registry.configure(mlflow_params)
    exp = registry.experiment(params.experiment, mlflow_params)
    fingerprint = detectors[0].detector.fingerprint
    dataset = hashlib.sha256(Path(build.out).read_bytes()).hexdigest()[:16]
    tags = {"task": "early", "llm": fingerprint.name, "llm_digest": fingerprint.weights_digest, "dataset": dataset}
    with mlflow.start_run(experiment_id=exp, run_name="early-detection comparison", tags=tags):
        for path in pngs:
            mlflow.log_artifact(str(path))
        for scorer in scorers:
            with mlflow.start_run(experiment_id=exp, run_name=scorer.name, nested=True, tags={**tags, "kind": scorer.kind}):
                m = results[scorer.name]
                mlflow.log_params({"scorer": scorer.name, "kind": scorer.kind, "features": scorer.features})
                mlflow.log_metrics({f"test_{k}": v for k, v in m.items() if k != "kind"})
                if scorer.kind == "detector":
                    mlflow.log_metric("val_auroc", scorer.detector.info["best_val_auroc"])


if __name__ == "__main__":
    main()
