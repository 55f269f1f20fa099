"""Stage train_early: the GRU early detector and its feature ablation (Lightning, GPU when present)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pandas as pd

from detectors.config import load_section, read_params
from detectors.early_detector import train_early_detector
from detectors.llm import MANIFEST, Fingerprint
from detectors.shards import write_json

log = logging.getLogger("train_early")


def variant_name(groups: list[str]) -> str:
    return "gru[" + "+".join(groups) + "]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    data = read_params(args.params)
    llm_params, build = load_section("llm", data=data), load_section("build_early", data=data)
    params = load_section("train_early", data=data)
    manifest = json.loads((Path(llm_params.dir) / MANIFEST).read_text())
    llm_ref = {"dir": str(Path(llm_params.dir).resolve()), "source": manifest["source"], "gguf_file": manifest["gguf_file"]}
    fingerprint = Fingerprint.from_dict(manifest["fingerprint"])
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
