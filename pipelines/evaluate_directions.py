"""Stage evaluate_directions: how good the CtrlA directions are, logged to dvc metrics/plots and MLflow.

- honesty: AUROC of the projection separating held-out true from false statements, per layer and at
  the steering layers (averaged like the monitor), and its dependence on the number of statements;
- confidence monitor as a hallucination scorer: ``data/eval/ctrla_early.parquet`` (``id``,
  ``ctrla_confidence`` = ``-min`` Eq. 2 over the answer's new non-stopword tokens, higher = more
  likely hallucinated) for every usable early-set row, AUROC on its val/test splits; per-token scores
  of the real-time set when it exists;
- honesty steering: TruthfulQA MC1 accuracy for each λ of the grid (CtrlA Fig. 2).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from detectors.ctrla import SCORE_COLUMN as CTRLA  # noqa: E402
from detectors.ctrla.directions import Directions  # noqa: E402
from detectors.ctrla.evaluation import (  # noqa: E402
    early_scores, last_token_states, load_truthfulqa, mc_accuracy, projection_scores, realtime_scores,
)  # fmt: skip
from detectors.ctrla.statements import load_statements  # noqa: E402
from detectors.ctrla.steering import steering_vectors  # noqa: E402
from detectors.evaluation.metrics import auroc  # noqa: E402
from detectors.io import write_json  # noqa: E402
from detectors.llm.loading import load_llm  # noqa: E402
from detectors.registry import store  # noqa: E402
from pipelines._stage import run, stage_params  # noqa: E402

log = logging.getLogger("evaluate_directions")
READS = (
    "llm", "build_early.features.prompt", "extract_directions", "evaluate_directions", "mlflow",
    "paths.llm", "paths.raw", "paths.qa", "paths.early", "paths.realtime", "paths.directions",
    "paths.ctrla_early", "paths.ctrla_realtime", "paths.evaluate_directions_metrics", "paths.plots",
)  # fmt: skip


def _auroc(labels, scores) -> float | None:
    labels = np.asarray(labels)
    if labels.min() == labels.max():
        return None
    return round(auroc(labels, scores), 4)


def honesty_metrics(llm, honesty: Directions, confidence: Directions, statements: pd.DataFrame, params, max_tokens) -> dict:
    """Held-out (test) true-vs-false AUROC per layer, at the chosen layers, and per number of extraction
    statements; the chosen layers' AUROC on the val statements too (the registry's alias rule uses that)."""
    held = statements[(statements["split"] == "test") & statements["label"].notna()]
    if held.empty or held["label"].nunique() < 2:
        log.warning("no held-out statements with both labels: the honesty AUROC is skipped")
        return {}
    val = statements[(statements["split"] == "val") & statements["label"].notna()]
    val_auroc, val_digest = None, None
    if val["label"].nunique() == 2:
        val_digest = store.validation_digest(val["id"])
        val_states = last_token_states(llm, params.eval_instruction, val["statement"].tolist(), params.batch_size, max_tokens)
        val_auroc = _auroc(val["label"].astype(int).to_numpy(), projection_scores(val_states, honesty.vectors, honesty.layers))
    states = last_token_states(llm, params.eval_instruction, held["statement"].tolist(), params.batch_size, max_tokens)
    labels = held["label"].astype(int).to_numpy()
    per_layer = projection_scores(states, honesty.vectors)
    curve = {str(n): _auroc(labels, projection_scores(states, v, honesty.layers)) for n, v in sorted(honesty.curve.items())}
    curve[str(honesty.config["n_statements"])] = _auroc(labels, projection_scores(states, honesty.vectors, honesty.layers))
    return {
        "n_heldout": int(len(held)),
        "auroc_per_layer": [_auroc(labels, per_layer[:, i]) for i in range(per_layer.shape[1])],
        "auroc_chosen_layers": _auroc(labels, projection_scores(states, honesty.vectors, honesty.layers)),
        "val_auroc_chosen_layers": val_auroc,
        "val_digest": val_digest,  # the val statements' ids: the registry compares only versions evaluated on the same ones
        "auroc_by_n_statements": curve,
        "confidence_direction_auroc_chosen_layers": _auroc(labels, projection_scores(states, confidence.vectors, confidence.layers)),
    }


def write_plots(metrics: dict, plots_dir: Path) -> list[Path]:
    """dvc plot CSVs and PNGs: honesty AUROC per layer, AUROC vs statements, TruthfulQA accuracy vs λ."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    h = metrics.get("honesty", {})
    if h:
        per_layer = pd.DataFrame({"layer": np.arange(1, len(h["auroc_per_layer"]) + 1), "auroc": h["auroc_per_layer"]})
        per_layer.to_csv(plots_dir / "ctrla_honesty_layers.csv", index=False)
        sizes = pd.DataFrame([{"n_statements": int(n), "auroc": a} for n, a in h["auroc_by_n_statements"].items()])
        sizes.to_csv(plots_dir / "ctrla_honesty_size.csv", index=False)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax.plot(per_layer["layer"], per_layer["auroc"], "o-")
        ax.axhline(0.5, color="k", ls=":", lw=0.8)
        ax.set(xlabel="layer", ylabel="held-out AUROC (true vs false)", title="Honesty direction per layer")
        ax2.plot(sizes["n_statements"], sizes["auroc"], "o-")
        ax2.set(xscale="log", xlabel="statements used for PCA", ylabel="AUROC at the steering layers", title="Dependence on |S|")
        fig.tight_layout()
        fig.savefig(plots_dir / "ctrla_honesty.png", dpi=120)
        pngs.append(plots_dir / "ctrla_honesty.png")
    t = metrics.get("truthfulqa", {})
    if t:
        grid = pd.DataFrame([{"lambda": float(k), "accuracy": v} for k, v in t["accuracy"].items()]).sort_values("lambda")
        grid.to_csv(plots_dir / "ctrla_truthfulqa.csv", index=False)
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot(grid["lambda"], grid["accuracy"], "o-")
        ax.set(xlabel="λ (fraction of the residual norm)", ylabel="MC1 accuracy", title=f"TruthfulQA under honesty steering (n={t['n']})")
        fig.tight_layout()
        fig.savefig(plots_dir / "ctrla_truthfulqa.png", dpi=120)
        pngs.append(plots_dir / "ctrla_truthfulqa.png")
    plt.close("all")
    return pngs


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "evaluate_directions")
    llm_params, extract, params = p["llm"], p["extract_directions"], p["evaluate_directions"]
    mlflow_params = p["mlflow"]
    honesty = Directions.load(Path(p["paths.directions"]) / "honesty")
    confidence = Directions.load(Path(p["paths.directions"]) / "confidence")
    statements = load_statements(extract.honesty.statements, p["paths.qa"])
    early = pd.read_parquet(p["paths.early"])
    early = early[early["status"] == "ok"].reset_index(drop=True)
    llm = load_llm(p["paths.llm"], llm_params.dtype, llm_params.device)
    honesty.require_llm(llm)
    confidence.require_llm(llm)
    mon = extract.monitor
    metrics: dict = {}
    timings: dict[str, float] = {}

    start = time.time()
    metrics["honesty"] = honesty_metrics(llm, honesty, confidence, statements, params, extract.honesty.statements.max_tokens)
    timings["honesty"] = time.time() - start

    start = time.time()
    scores = early_scores(llm, confidence, early, p["build_early.features.prompt"], mon.tau, mon.clip, params.batch_size)
    out = pd.DataFrame({"id": early["id"].astype(str), CTRLA: scores})
    Path(p["paths.ctrla_early"]).parent.mkdir(parents=True, exist_ok=True)
    out.to_parquet(p["paths.ctrla_early"], index=False)
    metrics["confidence_early"] = {
        f"{split}_auroc": _auroc(early.loc[early["split"] == split, "label"], scores[early["split"] == split]) for split in ("val", "test")
    }
    metrics["confidence_early"]["n"] = int(len(early))
    metrics["confidence_early"]["val_digest"] = store.validation_digest(early.loc[early["split"] == "val", "id"])
    timings["confidence_early"] = time.time() - start

    realtime = Path(p["paths.realtime"])
    if params.score_realtime and realtime.exists():
        start = time.time()
        frame = pd.read_parquet(realtime)
        frame = frame[frame["status"] == "ok"].reset_index(drop=True) if "status" in frame else frame
        per_token = realtime_scores(llm, confidence, frame, mon.tau, mon.clip, params.batch_size)
        pd.DataFrame({"id": frame["id"].astype(str), CTRLA: per_token}).to_parquet(p["paths.ctrla_realtime"], index=False)
        metrics["confidence_realtime"] = {"n": int(len(frame))}
        timings["confidence_realtime"] = time.time() - start
    else:
        log.info("real-time set not scored (score_realtime: %s, %s exists: %s)", params.score_realtime, realtime, realtime.exists())

    start = time.time()
    tqa = params.truthfulqa
    prefix, examples = load_truthfulqa(p["paths.raw"], tqa.task, tqa.file, tqa.limit, tqa.few_shot)
    accuracy = {}
    for lam in params.truthfulqa.lambdas:
        vectors = steering_vectors(honesty, lam, honesty.layers, extract.steering.relative) if lam else {}
        accuracy[str(lam)], _ = mc_accuracy(llm, prefix, examples, vectors)
        log.info("TruthfulQA MC1, λ = %g: %.3f", lam, accuracy[str(lam)])
    metrics["truthfulqa"] = {"n": len(examples), "accuracy": accuracy, "relative": extract.steering.relative}
    timings["truthfulqa"] = time.time() - start
    metrics["seconds"] = {k: round(v, 1) for k, v in timings.items()}

    write_json(p["paths.evaluate_directions_metrics"], metrics)
    pngs = write_plots(metrics, Path(p["paths.plots"]))
    log.info("honesty: %s", {k: v for k, v in metrics["honesty"].items() if k != "auroc_per_layer"})
    log.info("confidence (early set): %s; TruthfulQA: %s", metrics["confidence_early"], accuracy)

    store.configure(mlflow_params.tracking_uri)
    exp = store.experiment(params.experiment, mlflow_params.artifact_root)
    tags = {"task": "ctrla", "llm": llm.fingerprint.name, "llm_digest": llm.fingerprint.weights_digest}
    with mlflow.start_run(experiment_id=exp, run_name="ctrla directions", tags=tags):
        mlflow.log_params({"honesty_layers": str(honesty.layers), "confidence_layers": str(confidence.layers),
                           "n_statements": honesty.config["n_statements"], "lambdas": str(params.truthfulqa.lambdas)})  # fmt: skip
        flat = {"confidence_test_auroc": metrics["confidence_early"]["test_auroc"], "confidence_val_auroc": metrics["confidence_early"]["val_auroc"]}
        if metrics["honesty"]:
            flat["honesty_heldout_auroc"] = metrics["honesty"]["auroc_chosen_layers"]
            for i, a in enumerate(metrics["honesty"]["auroc_per_layer"], 1):
                if a is not None:
                    mlflow.log_metric("honesty_auroc_by_layer", a, step=i)
        mlflow.log_metrics({k: v for k, v in flat.items() if v is not None})
        for lam, acc in accuracy.items():
            mlflow.log_metric("truthfulqa_accuracy", acc, step=int(round(float(lam) * 1000)))
        for path in pngs:
            mlflow.log_artifact(str(path))


if __name__ == "__main__":
    run(main)
