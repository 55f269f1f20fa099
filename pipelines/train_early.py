"""Stage train_early: the GRU early detector and its feature ablation (Lightning, GPU when present)."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from detectors.config import load_section
from detectors.early_detector import train_early_detector
from detectors.llm import prepared_reference
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("train_early")


def variant_name(groups: list[str]) -> str:
    return "gru[" + "+".join(groups) + "]"


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    llm_params, build = load_section("llm", data=data), load_section("build_early", data=data)
    params = load_section("train_early", data=data)
    fingerprint, llm_ref = prepared_reference(llm_params.dir)
    frame = pd.read_parquet(build.out)
    out = Path(params.out_dir)
    variants = {"gru": params.features, **{variant_name(g): g for g in params.ablation}}
    metrics = {}
    for name, groups in variants.items():
        detector = train_early_detector(frame, groups, params, build.features, fingerprint, llm_ref)
        detector.save(out if name == "gru" else out / "ablation" / name)
        metrics[name] = {"features": groups, "threshold": detector.threshold, **detector.info}
        log.info("%s: %s", name, metrics[name])
    write_json(params.metrics, metrics)


if __name__ == "__main__":
    main()
