"""Stage train_realtime: the MLP real-time detector (Lightning, GPU when present), trained on each candidate
token set of ``train_realtime.tokens`` (entity tokens, all generated tokens); the one whose served score has the
best validation continuation AUROC is saved, and the metrics record every candidate's."""

from __future__ import annotations

import logging

import pandas as pd
from safetensors.numpy import load_file

from detectors.dior.realtime_training import train_and_choose
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from pipelines._stage import run, stage_params

log = logging.getLogger("train_realtime")
READS = (
    "build_realtime.hidden_layers", "build_realtime.prompt", "build_realtime.spacy_model", "train_realtime",
    "paths.llm", "paths.realtime", "paths.realtime_hidden", "paths.realtime_model", "paths.train_realtime_metrics",
)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "train_realtime")
    fingerprint, llm_ref = prepared_reference(p["paths.llm"])
    frame = pd.read_parquet(p["paths.realtime"])
    hidden = load_file(p["paths.realtime_hidden"])["hidden"]
    params = p["train_realtime"]
    detector = train_and_choose(
        frame, hidden, params.training, params.tokens,
        hidden_layers=p["build_realtime.hidden_layers"], prompt=p["build_realtime.prompt"], spacy_model=p["build_realtime.spacy_model"],
        fingerprint=fingerprint, llm_ref=llm_ref,
    )  # fmt: skip
    detector.save(p["paths.realtime_model"])
    metrics = {"mlp": {"threshold": detector.threshold, **detector.info}}
    write_json(p["paths.train_realtime_metrics"], metrics)
    log.info("%s", metrics)


if __name__ == "__main__":
    run(main)
