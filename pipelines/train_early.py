"""Stage train_early: the GRU early detector and its feature ablation (Lightning, GPU when present)."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from detectors.dior.early_detector import train_early_detector
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from pipelines._stage import run, stage_params

log = logging.getLogger("train_early")
READS = ("build_early.features", "train_early", "paths.llm", "paths.early", "paths.early_model", "paths.train_early_metrics")


def variant_name(groups: list[str]) -> str:
    return "gru[" + "+".join(groups) + "]"


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "train_early")
    params, features = p["train_early"], p["build_early.features"]
    fingerprint, llm_ref = prepared_reference(p["paths.llm"])
    frame = pd.read_parquet(p["paths.early"])
    out = Path(p["paths.early_model"])
    variants = {"gru": params.features, **{variant_name(g): g for g in params.ablation}}
    metrics = {}
    for name, groups in variants.items():
        detector = train_early_detector(frame, groups, params.training, features, fingerprint, llm_ref)
        detector.save(out if name == "gru" else out / "ablation" / name)
        metrics[name] = {"features": groups, "threshold": detector.threshold, **detector.info}
        log.info("%s: %s", name, metrics[name])
    write_json(p["paths.train_early_metrics"], metrics)


if __name__ == "__main__":
    run(main)
