"""Stage evaluate: every detector and training-free score on the test split, the same way.

Early set (question level): the GRU (and its ablations) beside first-token, attribution and probe
baselines. Real-time set: the MLP beside FLARE, Stitch-in-Time and token entropy at token, entity and
continuation level. CtrlA's confidence score joins both when its scores exist. Every score is a
:class:`~detectors.interfaces.Scorer` compared by :func:`detectors.evaluation.compare.compare`. Writes dvc
metrics (JSON), dvc plots (ROC curves, the attribution-entropy ECDF of DioR Fig. 7) and one MLflow run
per scorer, nested under one comparison run per set, all with the same metric names.
"""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from detectors.baselines import question_baselines, realtime_baselines  # noqa: E402
from detectors.ctrla import SCORE_COLUMN as CTRLA  # noqa: E402
from detectors.dior.early_detector import EarlyDetector  # noqa: E402
from detectors.dior.realtime_detector import RealtimeDetector  # noqa: E402
from detectors.evaluation.compare import compare  # noqa: E402
from detectors.evaluation.metrics import roc  # noqa: E402
from detectors.evaluation.scorers import DetectorScorer, realtime_detector_scorer  # noqa: E402
from detectors.evaluation.units import realtime_token_stats, realtime_units  # noqa: E402
from detectors.interfaces import Level  # noqa: E402
from detectors.io import file_digest, write_json  # noqa: E402
from detectors.registry import store  # noqa: E402
from pipelines._stage import run, stage_params  # noqa: E402

log = logging.getLogger("evaluate")
READS = (
    "train_early.training.threshold", "train_realtime.training.threshold", "evaluate", "mlflow",
    "paths.early", "paths.early_model", "paths.realtime", "paths.realtime_hidden", "paths.realtime_model",
    "paths.ctrla_early", "paths.ctrla_realtime", "paths.early_scores", "paths.realtime_scores",
    "paths.evaluate_early_metrics", "paths.evaluate_realtime_metrics", "paths.plots",
)  # fmt: skip


def plot_roc(scores: pd.DataFrame, results: dict, csv_dir: Path, ax, title: str) -> None:
    """ROC of each scorer on the test split: one CSV per curve (its own dvc plots series) and a panel."""
    csv_dir.mkdir(parents=True, exist_ok=True)
    for old in csv_dir.glob("*.csv"):
        old.unlink()
    test = scores[scores["split"] == "test"]
    for name, metrics in results.items():
        fpr, tpr, _ = roc(test["label"], test[name])
        pd.DataFrame({"fpr": fpr, "tpr": tpr}).to_csv(csv_dir / f"{name}.csv", index=False)
        ax.plot(fpr, tpr, label=f"{name} ({metrics['auroc']:.3f})")
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title)
    ax.legend(fontsize=7)


def write_early_plots(scores: pd.DataFrame, frame: pd.DataFrame, results: dict, plots_dir: Path) -> list[Path]:
    """ROC and the attribution-entropy ECDF (DioR Fig. 7), as dvc plots CSVs and PNGs for MLflow."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    plot_roc(scores, results, plots_dir / "early_roc", ax, "Early detection, test split")
    fig.tight_layout()
    fig.savefig(plots_dir / "early_roc.png", dpi=120)

    ecdf_dir = plots_dir / "early_entropy_ecdf"
    ecdf_dir.mkdir(parents=True, exist_ok=True)
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


def with_ctrla(frame: pd.DataFrame, path: Path) -> tuple[pd.DataFrame, bool]:
    """``frame`` joined with CtrlA's confidence scores by id, and whether they exist."""
    if not path.exists():
        log.info("no CtrlA scores at %s: the comparison goes on without them", path)
        return frame, False
    ctrla = pd.read_parquet(path)[["id", CTRLA]]
    return frame.merge(ctrla, on="id", how="left"), True


def log_table(task: str, level: str, results: dict) -> None:
    for name, m in sorted(results.items(), key=lambda kv: -kv[1]["auroc"]):
        log.info("%s %-8s %-40s AUROC %.3f  AUPRC %.3f  acc %.3f  F1 %.3f  ECE %.3f", task, level, name, m["auroc"], m["auprc"], m["accuracy"], m["f1"], m["ece"])


def evaluate_early(p, strategy: str, ece_bins: int) -> tuple[dict, list, list[Path]]:
    frame = pd.read_parquet(p["paths.early"])
    model_dir = Path(p["paths.early_model"])
    detectors = [DetectorScorer("gru", EarlyDetector.load(model_dir))]
    ablation_dir = model_dir / "ablation"
    detectors += [DetectorScorer(d.name, EarlyDetector.load(d)) for d in sorted(ablation_dir.iterdir())] if ablation_dir.exists() else []
    frame, _ = with_ctrla(frame, Path(p["paths.ctrla_early"]))
    scorers = detectors + question_baselines(set(frame.columns))
    results, scores = compare(frame, scorers, strategy, ece_bins)
    Path(p["paths.early_scores"]).parent.mkdir(parents=True, exist_ok=True)
    scores.to_parquet(p["paths.early_scores"], index=False)
    write_json(p["paths.evaluate_early_metrics"], results)
    log_table("early", Level.QUESTION.value, results)
    return results, scorers, write_early_plots(scores, frame, results, Path(p["paths.plots"]))


def evaluate_realtime(p, strategy: str, ece_bins: int) -> tuple[dict, list, Path]:
    """Metrics per level (``{level: {scorer: metrics}}``), the scorers of every level, and the ROC figure."""
    frame = pd.read_parquet(p["paths.realtime"])
    detector = RealtimeDetector.load(p["paths.realtime_model"])
    frame, _ = with_ctrla(frame, Path(p["paths.ctrla_realtime"]))  # its column becomes a score at every level
    mlp = detector.record_scores(frame, load_file(p["paths.realtime_hidden"])["hidden"])
    token_stats = realtime_token_stats(frame, mlp)
    stats = set().union(*(s.keys() for s in token_stats.values()))
    units = realtime_units(frame, token_stats)
    results, all_scores, scorers = {}, [], []
    plots = Path(p["paths.plots"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for ax, (level, table) in zip(axes, units.items()):
        level_scorers = [realtime_detector_scorer(detector.threshold, level)] + realtime_baselines(level, stats)
        results[level.value], scores = compare(table, level_scorers, strategy, ece_bins)
        scorers += level_scorers
        all_scores.append(scores.assign(level=level.value))
        plot_roc(scores, results[level.value], plots / f"realtime_roc_{level.value}", ax, f"Real-time, {level.value} level, test split")
        log_table("realtime", level.value, results[level.value])
    fig.tight_layout()
    png = plots / "realtime_roc.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    Path(p["paths.realtime_scores"]).parent.mkdir(parents=True, exist_ok=True)
    pd.concat(all_scores, ignore_index=True).to_parquet(p["paths.realtime_scores"], index=False)
    write_json(p["paths.evaluate_realtime_metrics"], results)
    return results, scorers, png


def log_comparison(run_name: str, tags: dict, pngs: list[Path], runs: dict[str, tuple], exp: str) -> None:
    """One parent run with the plots, one nested run per scorer name with the same metric names.

    ``runs[name] = (kind, features, metrics)``.
    """
    with mlflow.start_run(experiment_id=exp, run_name=run_name, tags=tags):
        for path in pngs:
            mlflow.log_artifact(str(path))
        for name, (kind, features, metrics) in runs.items():
            with mlflow.start_run(experiment_id=exp, run_name=name, nested=True, tags={**tags, "kind": kind}):
                mlflow.log_params({"scorer": name, "kind": kind, "features": features})
                mlflow.log_metrics(metrics)


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "evaluate")
    params, mlflow_params = p["evaluate"], p["mlflow"]
    early, early_scorers, early_pngs = evaluate_early(p, p["train_early.training.threshold"], params.ece_bins)
    realtime, rt_scorers, rt_png = evaluate_realtime(p, p["train_realtime.training.threshold"], params.ece_bins)

    store.configure(mlflow_params.tracking_uri)
    exp = store.experiment(params.experiment, mlflow_params.artifact_root)
    fingerprint = early_scorers[0].detector.fingerprint
    base = {"llm": fingerprint.name, "llm_digest": fingerprint.weights_digest}

    early_runs = {}
    for scorer in early_scorers:
        m = {f"test_{k}": v for k, v in early[scorer.name].items() if k != "kind"}
        m |= {"val_auroc": scorer.detector.info["best_val_auroc"]} if scorer.kind == "detector" else {}
        early_runs[scorer.name] = (scorer.kind, scorer.features, m)
    realtime_runs = {}
    for scorer in rt_scorers:  # one run per name, with its metrics at every level where it is defined
        m = {f"test_{level}_{k}": v for level, res in realtime.items() if scorer.name in res for k, v in res[scorer.name].items() if k != "kind"}
        continuation = realtime[Level.CONTINUATION.value].get(scorer.name)
        m |= {"test_auroc": continuation["auroc"]} if continuation else {}  # the continuation level is the headline
        realtime_runs[scorer.name] = (scorer.kind, scorer.features, m)

    tags = {**base, "task": "early", "dataset": file_digest(p["paths.early"])}
    log_comparison("early-detection comparison", tags, early_pngs, early_runs, exp)
    tags = {**base, "task": "realtime", "dataset": file_digest(p["paths.realtime"])}
    log_comparison("realtime-detection comparison", tags, [rt_png], realtime_runs, exp)


if __name__ == "__main__":
    run(main)
