"""Stage evaluate_directions: how good the CtrlA directions are, in a detailed report
(``paths.evaluate_directions_metrics``, which register_ctrla reads), its headline (a plain out; read at a glance),
figures (``dvc plots``) and MLflow.

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

import pandas as pd

from detectors.ctrla.directions import Directions
from detectors.ctrla.quality import confidence_metrics, early_set, honesty_metrics, realtime_metrics, realtime_set
from detectors.ctrla.statements import load_statements
from detectors.ctrla.truthfulqa import load_truthfulqa, truthfulqa_grid
from detectors.evaluation.plots import write_directions_plots
from detectors.evaluation.report import directions_headline, directions_markdown
from detectors.evaluation.tracking import log_directions
from detectors.io import write_json
from detectors.llm.loading import load_llm
from detectors.registry import store
from pipelines._stage import run, stage_params

log = logging.getLogger("evaluate_directions")
READS = (
    "llm",
    "build_early.features.prompt",
    "extract_directions",
    "evaluate_directions",
    "mlflow",
    "paths.llm",
    "paths.raw",
    "paths.qa",
    "paths.early",
    "paths.realtime",
    "paths.directions",
    "paths.ctrla_early",
    "paths.ctrla_realtime",
    "paths.evaluate_directions_metrics",
    "paths.evaluate_directions_headline",
    "paths.directions_table",
    "paths.plots",
)
DEPS = (
    "${paths.llm}",
    "${paths.directions}",
    "${paths.early}",
    "${paths.realtime}",
    "${paths.qa}",
)
OUTS = (
    "${paths.ctrla_early}",
    "${paths.ctrla_realtime}",
    ("${paths.evaluate_directions_metrics}", {"cache": False}, "the detailed report (register_ctrla reads it)"),
    ("${paths.plots}/ctrla_honesty_layers.csv", {"cache": False}, "the figures' numbers"),
    ("${paths.plots}/ctrla_honesty_size.csv", {"cache": False}),
    ("${paths.plots}/ctrla_truthfulqa.csv", {"cache": False}),
    (
        "${paths.evaluate_directions_headline}",
        {"cache": False},
        "at a glance: honesty and confidence test AUROC, TruthfulQA at λ = 0 and the best λ",
    ),
    ("${paths.directions_table}", {"cache": False}, "the same as a results page under docs/results (git-tracked)"),
)
PLOTS = (
    ("${paths.plots}/ctrla_honesty.png", {"cache": False}),
    ("${paths.plots}/ctrla_truthfulqa.png", {"cache": False}),
)


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "evaluate_directions")
    llm_params, extract, evaluation = params["llm"], params["extract_directions"], params["evaluate_directions"]
    mlflow_params = params["mlflow"]
    honesty = Directions.load(Path(params["paths.directions"]) / "honesty")
    confidence = Directions.load(Path(params["paths.directions"]) / "confidence")
    statements = load_statements(extract.honesty.statements, params["paths.qa"])
    early = pd.read_parquet(params["paths.early"])
    early = early[early["status"] == "ok"].reset_index(drop=True)
    llm = load_llm(params["paths.llm"], llm_params.dtype, llm_params.device)
    honesty.require_llm(llm)
    confidence.require_llm(llm)
    mon = extract.monitor
    metrics: dict = {}
    timings: dict[str, float] = {}

    start = time.time()
    metrics["honesty"] = honesty_metrics(
        llm, honesty, confidence, statements, evaluation, extract.honesty.statements.max_tokens
    )
    timings["honesty"] = time.time() - start

    start = time.time()
    monitored = early_set(llm, confidence, early, params["build_early.features.prompt"], evaluation.batch_size)
    metrics["confidence_early"], columns = confidence_metrics(
        monitored, early, confidence, mon.tau, mon.clip, evaluation.layer_window
    )
    Path(params["paths.ctrla_early"]).parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"id": early["id"].astype(str), **columns}).to_parquet(params["paths.ctrla_early"], index=False)
    timings["confidence_early"] = time.time() - start
    layers = {name: r["layers"] for name, r in metrics["confidence_early"]["ranges"].items()}

    realtime = Path(params["paths.realtime"])
    if evaluation.score_realtime and realtime.exists():
        start = time.time()
        frame = pd.read_parquet(realtime)
        frame = frame[frame["status"] == "ok"].reset_index(drop=True) if "status" in frame else frame
        metrics["confidence_realtime"], columns = realtime_metrics(
            realtime_set(llm, confidence, frame, evaluation.batch_size), frame, layers, mon.tau, mon.clip
        )
        pd.DataFrame({"id": frame["id"].astype(str), **columns}).to_parquet(params["paths.ctrla_realtime"], index=False)
        timings["confidence_realtime"] = time.time() - start
    else:
        log.info(
            "real-time set not scored (score_realtime: %s, %s exists: %s)",
            evaluation.score_realtime,
            realtime,
            realtime.exists(),
        )

    start = time.time()
    tqa = evaluation.truthfulqa
    prefix, examples = load_truthfulqa(params["paths.raw"], tqa.task, tqa.file, tqa.limit, tqa.few_shot)
    accuracy = truthfulqa_grid(llm, honesty, prefix, examples, tqa.lambdas, extract.steering.relative)
    metrics["truthfulqa"] = {"n": len(examples), "accuracy": accuracy, "relative": extract.steering.relative}
    timings["truthfulqa"] = time.time() - start
    metrics["seconds"] = {k: round(v, 1) for k, v in timings.items()}

    write_json(params["paths.evaluate_directions_metrics"], metrics)
    write_json(params["paths.evaluate_directions_headline"], directions_headline(metrics))
    Path(params["paths.directions_table"]).parent.mkdir(parents=True, exist_ok=True)
    Path(params["paths.directions_table"]).write_text(directions_markdown(metrics), encoding="utf-8")
    pngs = write_directions_plots(metrics, Path(params["paths.plots"]))
    log.info("honesty: %s", {k: v for k, v in metrics["honesty"].items() if "per_layer" not in k})
    log.info("confidence (early set): %s; TruthfulQA: %s", metrics["confidence_early"], accuracy)

    store.configure(mlflow_params.tracking_uri)
    tags = {"task": "ctrla", "llm": llm.fingerprint.name, "llm_digest": llm.fingerprint.weights_digest}
    run_params = {"n_statements": honesty.config["n_statements"], "lambdas": str(tqa.lambdas)}
    log_directions(metrics, pngs, tags, run_params, evaluation.experiment, mlflow_params.artifact_root)


if __name__ == "__main__":
    run(main)
