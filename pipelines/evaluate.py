"""Stage evaluate: every detector and training-free score on the test split, the same way.

Early set: the GRU (and its ablations) beside first-token and attribution baselines. Real-time set:
the MLP beside FLARE, Stitch-in-Time and token entropy at token, entity and continuation level.
CtrlA's confidence score joins both tables when its scores exist. Writes dvc metrics (JSON), dvc
plots (ROC curves, the attribution-entropy ECDF of DioR Fig. 7) and one MLflow run per scorer,
nested under one comparison run per set, all with the same metric names.
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
from safetensors.numpy import load_file  # noqa: E402

from detectors import registry  # noqa: E402
from detectors.config import load_section  # noqa: E402
from detectors.early_detector import EarlyDetector  # noqa: E402
from detectors.levels import level_tables  # noqa: E402
from detectors.metrics import binary_metrics, choose_threshold, platt, roc  # noqa: E402
from detectors.realtime_detector import RealtimeDetector, entity_token_table  # noqa: E402
from detectors.scorers import EARLY_BASELINES, ColumnScorer, DetectorScorer, LogisticScorer  # noqa: E402
from detectors.shards import write_json  # noqa: E402
from pipelines._stage import stage_params  # noqa: E402

log = logging.getLogger("evaluate")
CTRLA = ColumnScorer("ctrla_confidence", "ctrla_confidence")


def evaluate_scorers(frame: pd.DataFrame, scorers, strategy: str, ece_bins: int) -> tuple[dict, pd.DataFrame]:
    """Metrics per scorer on the test split (threshold and calibration from validation) and all scores.

    A scorer with its own ``threshold`` (a trained detector scoring the unit it was trained on) keeps it.
    """
    ok = frame[frame["status"] == "ok"].reset_index(drop=True)
    val, test = ok[ok["split"] == "val"], ok[ok["split"] == "test"]
    scores = ok[["id", "split", "label"]].copy()
    results = {}
    for scorer in scorers:
        scores[scorer.name] = scorer.score(ok)
        s_val, s_test = scores.loc[val.index, scorer.name], scores.loc[test.index, scorer.name]
        threshold = getattr(scorer, "threshold", None)
        threshold = choose_threshold(val["label"], s_val, strategy) if threshold is None else threshold
        prob = s_test if scorer.is_probability else platt(val["label"], s_val)(s_test)
        results[scorer.name] = {"kind": scorer.kind, **binary_metrics(test["label"], s_test, threshold, prob, ece_bins)}
    return results, scores


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


def with_ctrla(frame: pd.DataFrame, path: Path) -> tuple[pd.DataFrame, list]:
    """``frame`` joined with CtrlA's confidence scores by id, and the scorer, when the scores exist."""
    if not path.exists():
        log.info("no CtrlA scores at %s: the comparison goes on without them", path)
        return frame, []
    ctrla = pd.read_parquet(path)[["id", "ctrla_confidence"]]
    return frame.merge(ctrla, on="id", how="left"), [CTRLA]


def evaluate_early(build, train, params) -> tuple[dict, list, pd.DataFrame, list[Path]]:
    frame = pd.read_parquet(build.out)
    model_dir = Path(train.out_dir)
    detectors = [DetectorScorer("gru", EarlyDetector.load(model_dir))]
    ablation_dir = model_dir / "ablation"
    detectors += [DetectorScorer(d.name, EarlyDetector.load(d)) for d in sorted(ablation_dir.iterdir())] if ablation_dir.exists() else []
    frame, ctrla = with_ctrla(frame, Path(params.ctrla_early))
    scorers = detectors + [LogisticScorer()] + list(EARLY_BASELINES) + ctrla
    results, scores = evaluate_scorers(frame, scorers, train.threshold, params.ece_bins)
    Path(params.scores).parent.mkdir(parents=True, exist_ok=True)
    scores.to_parquet(params.scores, index=False)
    write_json(params.metrics, results)
    for name, m in sorted(results.items(), key=lambda kv: -kv[1]["auroc"]):
        log.info("early %-40s AUROC %.3f  AUPRC %.3f  acc %.3f  F1 %.3f  ECE %.3f", name, m["auroc"], m["auprc"], m["accuracy"], m["f1"], m["ece"])
    return results, scorers, frame, write_early_plots(scores, frame, results, Path(params.plots_dir))


def realtime_token_scores(frame: pd.DataFrame, hidden: np.ndarray, detector: RealtimeDetector) -> dict[str, dict[str, np.ndarray]]:
    """Per record, per generated token: the MLP's probability (entity tokens), probability, entropy, CtrlA."""
    x, _, where = entity_token_table(frame, hidden)
    mlp = detector.predict_features(x) if len(x) else np.zeros(0)
    out = {}
    for row in frame[frame["status"] == "ok"].itertuples():
        scores = {"mlp": np.full(len(row.gen_ids), np.nan), "prob": np.asarray(row.prob), "entropy": np.asarray(row.entropy)}
        if isinstance(getattr(row, "ctrla_confidence", None), (list, np.ndarray)):
            scores["ctrla_confidence"] = np.asarray(row.ctrla_confidence)
        out[row.id] = scores
    for (record, token), p in zip(where[["record", "token"]].itertuples(index=False), mlp):
        out[record]["mlp"][token] = p
    return out


def evaluate_realtime(build, train, params) -> tuple[dict, list, Path]:
    """Metrics per level (``{level: {scorer: metrics}}``), the scorers, and the ROC figure."""
    frame = pd.read_parquet(build.out)
    detector = RealtimeDetector.load(train.out_dir)
    frame, _ = with_ctrla(frame, Path(params.ctrla_realtime))  # its column becomes a score at every level
    tables = level_tables(frame, realtime_token_scores(frame, load_file(build.hidden_out)["hidden"], detector))
    results, all_scores, scorers = {}, [], {}
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for ax, (level, table) in zip(axes, tables.items()):
        names = [c for c in table.columns if c not in ("id", "split", "label", "status")]
        level_scorers = []
        for name in names:
            if name == "mlp":  # trained on tokens: its own threshold there; aggregated levels choose theirs on val
                token = level == "token"
                scorer = ColumnScorer(name, name, kind="detector", is_probability=token, threshold=detector.threshold if token else None)
            else:
                scorer = ColumnScorer(name, name)
            level_scorers.append(scorer)
            scorers[name] = scorer
        results[level], scores = evaluate_scorers(table, level_scorers, train.threshold, params.ece_bins)
        all_scores.append(scores.assign(level=level))
        plot_roc(scores, results[level], Path(params.plots_dir) / f"realtime_roc_{level}", ax, f"Real-time, {level} level, test split")
        for name, m in sorted(results[level].items(), key=lambda kv: -kv[1]["auroc"]):
            log.info("realtime %-8s %-18s AUROC %.3f  AUPRC %.3f  acc %.3f  F1 %.3f  ECE %.3f", level, name, m["auroc"], m["auprc"], m["accuracy"], m["f1"], m["ece"])
    fig.tight_layout()
    png = Path(params.plots_dir) / "realtime_roc.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    Path(params.realtime_scores).parent.mkdir(parents=True, exist_ok=True)
    pd.concat(all_scores, ignore_index=True).to_parquet(params.realtime_scores, index=False)
    write_json(params.realtime_metrics, results)
    return results, list(scorers.values()), png


def log_comparison(run_name: str, tags: dict, pngs: list[Path], scorers, metrics_of, exp: str) -> None:
    """One parent run with the plots, one nested run per scorer with the same metric names."""
    with mlflow.start_run(experiment_id=exp, run_name=run_name, tags=tags):
        for path in pngs:
            mlflow.log_artifact(str(path))
        for scorer in scorers:
            with mlflow.start_run(experiment_id=exp, run_name=scorer.name, nested=True, tags={**tags, "kind": scorer.kind}):
                mlflow.log_params({"scorer": scorer.name, "kind": scorer.kind, "features": scorer.features})
                mlflow.log_metrics(metrics_of(scorer))


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    params, mlflow_params = load_section("evaluate", data=data), load_section("mlflow", data=data)
    build_early, train_early = load_section("build_early", data=data), load_section("train_early", data=data)
    build_rt, train_rt = load_section("build_realtime", data=data), load_section("train_realtime", data=data)
    early, early_scorers, early_frame, early_pngs = evaluate_early(build_early, train_early, params)
    realtime, rt_scorers, rt_png = evaluate_realtime(build_rt, train_rt, params)

    registry.configure(mlflow_params)
    exp = registry.experiment(params.experiment, mlflow_params)
    fingerprint = early_scorers[0].detector.fingerprint
    base = {"llm": fingerprint.name, "llm_digest": fingerprint.weights_digest}

    def early_metrics(scorer) -> dict:
        m = {f"test_{k}": v for k, v in early[scorer.name].items() if k != "kind"}
        return m | ({"val_auroc": scorer.detector.info["best_val_auroc"]} if scorer.kind == "detector" else {})

    def realtime_metrics(scorer) -> dict:
        m = {f"test_{level}_{k}": v for level, res in realtime.items() if scorer.name in res for k, v in res[scorer.name].items() if k != "kind"}
        sentence = realtime["sentence"].get(scorer.name)
        return m | ({"test_auroc": sentence["auroc"]} if sentence else {})  # the continuation level is the headline

    digest = hashlib.sha256(Path(build_early.out).read_bytes()).hexdigest()[:16]
    log_comparison("early-detection comparison", {**base, "task": "early", "dataset": digest}, early_pngs, early_scorers, early_metrics, exp)
    digest = hashlib.sha256(Path(build_rt.out).read_bytes()).hexdigest()[:16]
    log_comparison("realtime-detection comparison", {**base, "task": "realtime", "dataset": digest}, [rt_png], rt_scorers, realtime_metrics, exp)


if __name__ == "__main__":
    main()
