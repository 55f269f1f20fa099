"""Stage evaluate_directions: how good the CtrlA directions are, logged to dvc metrics/plots and MLflow.

- layer ranges: each concept at CtrlA's range scaled to the LLM's depth (``paper``) and at the window of
  the same width (or ``layer_window``) chosen on validation (``validation``: honesty on the val
  statements, confidence on the early set's val split; :func:`detectors.ctrla.layer_ranges.choose_window`);
- honesty: AUROC of the projection separating held-out true from false statements, per layer and for
  each range (averaged over its layers like the monitor), and its dependence on the number of statements;
- confidence monitor as a hallucination scorer: ``data/eval/ctrla_early.parquet`` (``id``, one column
  per range: ``ctrla_confidence`` (paper) and ``ctrla_confidence[val-layers]``, each ``-min`` Eq. 2 over
  the answer's new non-stopword tokens, higher = more likely hallucinated) for every usable early-set
  row, AUROC on its val/test splits; per-token scores of the real-time set (same columns) when it
  exists; how often the monitor fires at τ on the test split (answers; generated tokens);
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

from detectors.ctrla import RANGE_COLUMNS  # noqa: E402
from detectors.ctrla.directions import Directions  # noqa: E402
from detectors.ctrla.quality import (  # noqa: E402
    MonitoredSet, early_set, last_token_states, load_truthfulqa, mc_accuracy, projection_scores, realtime_set,
)  # fmt: skip
from detectors.ctrla.layer_ranges import choose_window  # noqa: E402
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
    if len(labels) == 0 or labels.min() == labels.max():
        return None
    return round(auroc(labels, scores), 4)


def _pooled(per_layer: np.ndarray, layers: list[int]) -> np.ndarray:
    """The monitor's and steering's pooling: the mean of the per-layer projections ``[N, L]`` over ``layers``."""
    return per_layer[:, [layer - 1 for layer in layers]].mean(1)


def honesty_metrics(llm, honesty: Directions, confidence: Directions, statements: pd.DataFrame, params, max_tokens) -> dict:
    """Held-out (test) true-vs-false AUROC per layer, for the paper's range and for the window chosen on the val
    statements (whose val AUROC the registry's alias rule uses), and per number of extraction statements."""
    held = statements[(statements["split"] == "test") & statements["label"].notna()]
    if held.empty or held["label"].nunique() < 2:
        log.warning("no held-out statements with both labels: the honesty AUROC is skipped")
        return {}
    states = last_token_states(llm, params.eval_instruction, held["statement"].tolist(), params.batch_size, max_tokens)
    labels = held["label"].astype(int).to_numpy()
    per_layer = projection_scores(states, honesty.vectors)
    ranges = {"paper": {"layers": honesty.layers, "val_auroc": None, "test_auroc": _auroc(labels, _pooled(per_layer, honesty.layers))}}
    val = statements[(statements["split"] == "val") & statements["label"].notna()]
    val_digest, val_per_layer = None, []
    if val["label"].nunique() == 2:
        val_digest = store.validation_digest(val["id"])
        val_labels = val["label"].astype(int).to_numpy()
        val_states = last_token_states(llm, params.eval_instruction, val["statement"].tolist(), params.batch_size, max_tokens)
        val_proj = projection_scores(val_states, honesty.vectors)
        val_per_layer = [_auroc(val_labels, val_proj[:, i]) for i in range(val_proj.shape[1])]
        ranges["paper"]["val_auroc"] = _auroc(val_labels, _pooled(val_proj, honesty.layers))
        width = params.layer_window or len(honesty.layers)
        choice = choose_window(lambda w: _auroc(val_labels, _pooled(val_proj, w)), per_layer.shape[1], width, "evaluate_directions.layer_window")
        ranges["validation"] = {"layers": choice.layers, "val_auroc": choice.val_auroc, "test_auroc": _auroc(labels, _pooled(per_layer, choice.layers))}
    else:
        log.warning("the val statements lack one of the labels: no honesty layer range is chosen on validation")
    curve = {str(n): _auroc(labels, projection_scores(states, v, honesty.layers)) for n, v in sorted(honesty.curve.items())}
    curve[str(honesty.config["n_statements"])] = ranges["paper"]["test_auroc"]
    return {
        "n_heldout": int(len(held)),
        "n_val": int(len(val)),
        "auroc_per_layer": [_auroc(labels, per_layer[:, i]) for i in range(per_layer.shape[1])],
        "val_auroc_per_layer": val_per_layer,
        "ranges": ranges,
        "val_digest": val_digest,  # the val statements' ids: the registry compares only versions evaluated on the same ones
        "auroc_by_n_statements": curve,  # at the paper's range
        "confidence_direction_test_auroc": _auroc(labels, projection_scores(states, confidence.vectors, confidence.layers)),
    }


def confidence_metrics(monitored: MonitoredSet, frame: pd.DataFrame, confidence: Directions, tau: float, clip: float,
                       width: int | None) -> tuple[dict, dict[str, np.ndarray]]:  # fmt: skip
    """The monitor's score columns of the early set per range (the window chosen on its val split), their val/test
    AUROC and how often the monitor fires at τ on the test split."""
    split, labels = frame["split"].to_numpy(), frame["label"].to_numpy()
    val, test = split == "val", split == "test"
    choice = choose_window(
        lambda w: _auroc(labels[val], monitored.answer_scores(w, tau, clip)[val]), confidence.fingerprint.num_layers,
        width or len(confidence.layers), "evaluate_directions.layer_window",
    )  # fmt: skip
    layers = {"paper": confidence.layers, "validation": choice.layers}
    if choice.val_auroc is None:
        log.warning("the early set's val split lacks one of the labels: no confidence layer range is chosen on validation")
        del layers["validation"]
    metrics: dict = {"n": int(len(frame)), "n_test": int(test.sum()), "val_digest": store.validation_digest(frame.loc[val, "id"]), "ranges": {}}
    columns = {}
    for name, chosen in layers.items():
        scores = columns[RANGE_COLUMNS[name]] = monitored.answer_scores(chosen, tau, clip)
        rates = monitored.trigger_rates(chosen, tau, clip, test)
        metrics["ranges"][name] = {
            "layers": chosen, "val_auroc": _auroc(labels[val], scores[val]), "test_auroc": _auroc(labels[test], scores[test]),
            "test_trigger_rate": rates["sequence"], "test_token_trigger_rate": rates["token"],
        }  # fmt: skip
    return metrics, columns


def realtime_metrics(monitored: MonitoredSet, frame: pd.DataFrame, layers: dict[str, list[int]], tau: float, clip: float) -> tuple[dict, dict]:
    """Per-token score columns of the real-time set per range, and how often the monitor fires on its test split."""
    test = frame["split"].to_numpy() == "test"
    metrics: dict = {"n": int(len(frame)), "n_test": int(test.sum()), "ranges": {}}
    columns = {}
    for name, chosen in layers.items():
        columns[RANGE_COLUMNS[name]] = monitored.token_scores(chosen, tau, clip)
        rates = monitored.trigger_rates(chosen, tau, clip, test)
        metrics["ranges"][name] = {
            "layers": chosen, "test_token_trigger_rate": rates["token"], "test_new_content_token_trigger_rate": rates["new_content_token"],
            "test_continuation_trigger_rate": rates["sequence"],
        }  # fmt: skip
    return metrics, columns


def write_plots(metrics: dict, plots_dir: Path) -> list[Path]:
    """dvc plot CSVs and PNGs: honesty AUROC per layer, AUROC vs statements, TruthfulQA accuracy vs λ."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    h = metrics.get("honesty", {})
    if h:
        per_layer = pd.DataFrame({"layer": np.arange(1, len(h["auroc_per_layer"]) + 1), "auroc": h["auroc_per_layer"]})
        if h["val_auroc_per_layer"]:
            per_layer["val_auroc"] = h["val_auroc_per_layer"]
        per_layer.to_csv(plots_dir / "ctrla_honesty_layers.csv", index=False)
        sizes = pd.DataFrame([{"n_statements": int(n), "auroc": a} for n, a in h["auroc_by_n_statements"].items()])
        sizes.to_csv(plots_dir / "ctrla_honesty_size.csv", index=False)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax.plot(per_layer["layer"], per_layer["auroc"], "o-", label="test statements")
        if "val_auroc" in per_layer:
            ax.plot(per_layer["layer"], per_layer["val_auroc"], "s--", alpha=0.6, label="val statements")
        for (name, r), colour in zip(h["ranges"].items(), ("tab:grey", "tab:green")):
            ax.axvspan(r["layers"][0] - 0.5, r["layers"][-1] + 0.5, color=colour, alpha=0.12, label=f"{name} range (test {r['test_auroc']})")
        ax.axhline(0.5, color="k", ls=":", lw=0.8)
        ax.legend(fontsize=7)
        ax.set(xlabel="layer", ylabel="held-out AUROC (true vs false)", title="Honesty direction per layer")
        ax2.plot(sizes["n_statements"], sizes["auroc"], "o-")
        ax2.set(xscale="log", xlabel="statements used for PCA", ylabel="AUROC at the paper's steering layers", title="Dependence on |S|")
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
    monitored = early_set(llm, confidence, early, p["build_early.features.prompt"], params.batch_size)
    metrics["confidence_early"], columns = confidence_metrics(monitored, early, confidence, mon.tau, mon.clip, params.layer_window)
    Path(p["paths.ctrla_early"]).parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"id": early["id"].astype(str), **columns}).to_parquet(p["paths.ctrla_early"], index=False)
    timings["confidence_early"] = time.time() - start
    layers = {name: r["layers"] for name, r in metrics["confidence_early"]["ranges"].items()}

    realtime = Path(p["paths.realtime"])
    if params.score_realtime and realtime.exists():
        start = time.time()
        frame = pd.read_parquet(realtime)
        frame = frame[frame["status"] == "ok"].reset_index(drop=True) if "status" in frame else frame
        metrics["confidence_realtime"], columns = realtime_metrics(realtime_set(llm, confidence, frame, params.batch_size), frame, layers, mon.tau, mon.clip)
        pd.DataFrame({"id": frame["id"].astype(str), **columns}).to_parquet(p["paths.ctrla_realtime"], index=False)
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
    log.info("honesty: %s", {k: v for k, v in metrics["honesty"].items() if "per_layer" not in k})
    log.info("confidence (early set): %s; TruthfulQA: %s", metrics["confidence_early"], accuracy)

    store.configure(mlflow_params.tracking_uri)
    exp = store.experiment(params.experiment, mlflow_params.artifact_root)
    tags = {"task": "ctrla", "llm": llm.fingerprint.name, "llm_digest": llm.fingerprint.weights_digest}
    with mlflow.start_run(experiment_id=exp, run_name="ctrla directions", tags=tags):
        mlflow.log_params({"n_statements": honesty.config["n_statements"], "lambdas": str(params.truthfulqa.lambdas)})
        mlflow.log_params({f"{concept}_{name}_layers": str(r["layers"]) for concept, section in (("honesty", metrics["honesty"]),
                           ("confidence", metrics["confidence_early"])) for name, r in section.get("ranges", {}).items()})  # fmt: skip
        mlflow.log_metrics(flat_metrics(metrics))
        for i, a in enumerate(metrics["honesty"].get("auroc_per_layer", []), 1):
            if a is not None:
                mlflow.log_metric("honesty_auroc_by_layer", a, step=i)
        for lam, acc in accuracy.items():
            mlflow.log_metric("truthfulqa_accuracy", acc, step=int(round(float(lam) * 1000)))
        for path in pngs:
            mlflow.log_artifact(str(path))


def flat_metrics(metrics: dict) -> dict[str, float]:
    """MLflow's flat view of the ranges: ``<concept>_<range>_<metric>`` (e.g. ``confidence_validation_test_auroc``)."""
    sections = {"honesty": metrics.get("honesty", {}), "confidence": metrics["confidence_early"],
                "confidence_realtime": metrics.get("confidence_realtime", {})}  # fmt: skip
    return {f"{concept}_{name}_{key}": value for concept, section in sections.items() for name, r in section.get("ranges", {}).items()
            for key, value in r.items() if key != "layers" and value is not None}  # fmt: skip


if __name__ == "__main__":
    run(main)
