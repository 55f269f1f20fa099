"""Stage extract_directions: CtrlA honesty and confidence directions (§3.2.1) from contrast pairs, per layer.

Writes ``<out_dir>/honesty`` and ``<out_dir>/confidence`` (safetensors + detector.json with the layer
indices, the LLM fingerprint and the dtype they were extracted in) and a metrics JSON: explained variance
per layer and how close directions fitted on fewer statements come to the full one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch

from detectors.ctrla.directions import extract
from detectors.ctrla.layers import resolve_range
from detectors.ctrla.statements import load_statements
from detectors.io import write_json
from detectors.llm.loading import load_llm, prepared_reference
from pipelines._stage import run, stage_params

log = logging.getLogger("extract_directions")
READS = ("llm", "extract_directions", "paths.llm", "paths.qa", "paths.directions", "paths.extract_directions_metrics")
CONCEPTS = ("honesty", "confidence")


def curve_similarity(directions, layers: list[int]) -> dict[str, float]:
    """Mean |cosine| at ``layers`` between the directions fitted on n statements and on all of them."""
    full = directions.at(layers)
    return {str(n): round(float(torch.nn.functional.cosine_similarity(v[[l - 1 for l in layers]], full).mean()), 4)  # noqa: E741
            for n, v in sorted(directions.curve.items())}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "extract_directions")
    llm_params, params = p["llm"], p["extract_directions"]
    statements = {c: load_statements(getattr(params, c).statements, p["paths.qa"]) for c in CONCEPTS}  # fail early
    llm = load_llm(p["paths.llm"], llm_params.dtype, llm_params.device)
    torch.manual_seed(params.seed)
    _, llm_ref = prepared_reference(p["paths.llm"])  # extract() adds the dtype the directions are extracted in
    layers = {
        "honesty": resolve_range(params.steering.layers, llm.fingerprint.num_layers),
        "confidence": resolve_range(params.monitor.layers, llm.fingerprint.num_layers),
    }
    metrics = {}
    for concept in CONCEPTS:
        start = time.time()
        contrast = getattr(params, concept)
        config = {
            "llm": llm_ref,
            "instructions": {"positive": contrast.positive, "negative": contrast.negative, "chat": contrast.chat},
            "statements": dataclasses.asdict(contrast.statements),
            "steering": dataclasses.asdict(params.steering),
            "monitor": dataclasses.asdict(params.monitor),
            "seed": params.seed,
        }
        directions, stats = extract(
            llm, concept, contrast, statements[concept], layers[concept], params.batch_size, params.seed, params.size_curve, config
        )
        directions.save(Path(p["paths.directions"]) / concept)
        ev = directions.explained_variance.numpy()
        chosen = np.array(layers[concept]) - 1
        metrics[concept] = {
            "n_statements": directions.config["n_statements"],
            "n_tokens": directions.config["n_tokens"],
            "layers": layers[concept],
            "explained_variance_chosen": round(float(ev[chosen].mean()), 4),
            "explained_variance_per_layer": [round(float(x), 4) for x in ev],
            "size_curve_cosine": curve_similarity(directions, layers[concept]),
            "seconds": round(time.time() - start, 1),
        }
        log.info("%s: %s", concept, {k: v for k, v in metrics[concept].items() if k != "explained_variance_per_layer"})
        del stats
    write_json(p["paths.extract_directions_metrics"], metrics)


if __name__ == "__main__":
    run(main)
