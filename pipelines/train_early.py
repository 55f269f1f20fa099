"""Stage train_early: the early detectors and their feature ablation (Lightning, GPU when present).

Each detector of ``train_early.detectors`` (``dior-early``: DioR's RNN over IG(Q); ``dior-early-extended``: the stronger
feature set) and each ablation (``gru[<groups>]``) is a seed ensemble (``train_early.training.seeds`` GRUs, their mean
probability), written to ``paths.early_model/<name>/`` with one entry in ``paths.train_early_metrics`` (each seed's
validation AUROC beside the ensemble's, the threshold at the validation prevalence). The directory is rebuilt beside the
old one and swapped in at the end, so it holds exactly this run's detectors (evaluate loads every sub-directory) and a
failed run leaves the last one.
"""

from __future__ import annotations

import logging

import pandas as pd

from detectors.dior.early_detector import train_early_detector
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from detectors.training import reported
from pipelines._stage import run, stage_params
from pipelines._swap import swapped_in

log = logging.getLogger("train_early")
READS = (
    "build_early.features",
    "train_early",
    "paths.llm",
    "paths.early",
    "paths.early_model",
    "paths.train_early_metrics",
)
DEPS = (
    "${paths.early}",
    "${paths.llm}/llm.json",
)
OUTS = (
    "${paths.early_model}",
    ("${paths.train_early_metrics}", {"cache": False}),
)


def ablation_name(groups: list[str]) -> str:
    return "gru[" + "+".join(groups) + "]"


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "train_early")
    train, features = params["train_early"], params["build_early.features"]
    fingerprint, llm_ref = prepared_reference(params["paths.llm"])
    frame = pd.read_parquet(params["paths.early"])
    variants = {**train.detectors, **{ablation_name(g): g for g in train.ablation}}
    metrics = {}
    with swapped_in(params["paths.early_model"]) as partial:
        for name, groups in variants.items():
            detector = train_early_detector(frame, groups, train.training, features, fingerprint, llm_ref, name=name)
            detector.save(partial / name)
            metrics[name] = {"features": groups, "threshold": detector.threshold, **reported(detector.info)}
            log.info("%s: %s", name, metrics[name])
    write_json(params["paths.train_early_metrics"], metrics)


if __name__ == "__main__":
    run(main)
