"""Stage train_realtime: the MLP real-time detector (Lightning, GPU when present; a seed ensemble of
``train_realtime.training.seeds`` nets), trained on each candidate training set of ``train_realtime.tokens`` (the
continuations' entity tokens or all their tokens, the early set's QA answer tokens, or several). The candidate
``train_realtime.default`` is saved unless another beats its served validation AUROC on ``train_realtime.choose_on``
by a paired 95 % bootstrap interval above 0 (records no candidate early-stopped on); the metrics record the choice
(``choice``: every candidate's difference, the ties) and every candidate's served AUROC on both sets' validation and
test records."""

from __future__ import annotations

import logging

import pandas as pd
from safetensors.numpy import load_file

from detectors.dior.realtime_detector import answer_records
from detectors.dior.realtime_training import TokenSets, train_and_choose
from detectors.errors import InputError
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from detectors.training import reported
from pipelines._stage import run, stage_params

log = logging.getLogger("train_realtime")
READS = (
    "build_realtime.hidden_layers",
    "build_realtime.prompt",
    "build_realtime.spacy_model",
    "build_early.answer_hidden_layers",
    "train_realtime",
    "paths.llm",
    "paths.realtime",
    "paths.realtime_hidden",
    "paths.early",
    "paths.early_answer_hidden",
    "paths.realtime_model",
    "paths.train_realtime_metrics",
)
DEPS = (
    "${paths.realtime}",
    "${paths.realtime_hidden}",
    "${paths.early}",
    "${paths.early_answer_hidden}",
    "${paths.llm}/llm.json",
)
OUTS = (
    "${paths.realtime_model}",
    ("${paths.train_realtime_metrics}", {"cache": False}),
)


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "train_realtime")
    fingerprint, llm_ref = prepared_reference(params["paths.llm"])
    layers, answer_layers = params["build_realtime.hidden_layers"], params["build_early.answer_hidden_layers"]
    if layers != answer_layers:
        raise InputError(
            f"build_early.answer_hidden_layers = {answer_layers} but build_realtime.hidden_layers = {layers}: "
            "the real-time "
            "detector reads one set of layers, so set both to the same list"
        )
    sets = TokenSets(
        (pd.read_parquet(params["paths.realtime"]), load_file(params["paths.realtime_hidden"])["hidden"]),
        (
            answer_records(pd.read_parquet(params["paths.early"])),
            load_file(params["paths.early_answer_hidden"])["hidden"],
        ),
    )
    train = params["train_realtime"]
    detector = train_and_choose(
        sets,
        train.training,
        train.tokens,
        train.choose_on,
        train.default,
        train.stop_share,
        hidden_layers=params["build_realtime.hidden_layers"],
        prompt=params["build_realtime.prompt"],
        spacy_model=params["build_realtime.spacy_model"],
        fingerprint=fingerprint,
        llm_ref=llm_ref,
    )
    detector.save(params["paths.realtime_model"])
    metrics = {"mlp": {"threshold": detector.threshold, **reported(detector.info)}}
    write_json(params["paths.train_realtime_metrics"], metrics)
    log.info("%s", metrics)


if __name__ == "__main__":
    run(main)
