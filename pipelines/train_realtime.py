"""Stage train_realtime: the MLP real-time detector over entity tokens (Lightning, GPU when present)."""

from __future__ import annotations

import logging

import pandas as pd
from safetensors.numpy import load_file

from detectors.config import load_section
from detectors.early import resolve_layers
from detectors.llm import prepared_reference
from detectors.realtime_detector import train_realtime_detector
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("train_realtime")


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    llm_params, build = load_section("llm", data=data), load_section("build_realtime", data=data)
    params = load_section("train_realtime", data=data)
    fingerprint, llm_ref = prepared_reference(llm_params.dir)
    positions = resolve_layers(build.hidden_layers, fingerprint.num_layers, "build_realtime.hidden_layers")
    frame = pd.read_parquet(build.out)
    hidden = load_file(build.hidden_out)["hidden"]
    detector = train_realtime_detector(frame, hidden, params, build, positions, fingerprint, llm_ref)
    detector.save(params.out_dir)
    metrics = {"mlp": {"threshold": detector.threshold, **detector.info}}
    write_json(params.metrics, metrics)
    log.info("%s", metrics)


if __name__ == "__main__":
    main()
