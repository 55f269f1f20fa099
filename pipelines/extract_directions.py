"""Stage extract_directions: CtrlA honesty and confidence directions (§3.2.1) from contrast pairs, per layer.

Writes ``<out_dir>/honesty`` and ``<out_dir>/confidence`` (safetensors + detector.json with the layer
indices and the LLM fingerprint) and a metrics JSON: explained variance per layer and how close
directions fitted on fewer statements come to the full one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch

from detectors.config import load_section
from detectors.directions import extract, load_statements, resolve_range
from detectors.llm import load_llm
from detectors.shards import write_json
from pipelines._stage import stage_params

log = logging.getLogger("extract_directions")
CONCEPTS = ("honesty", "confidence")


def curve_similarity(directions, layers: list[int]) -> dict[str, float]:
    """Mean |cosine| at ``layers`` between the directions fitted on n statements and on all of them."""
    full = directions.at(layers)
    return {str(n): round(float(torch.nn.functional.cosine_similarity(v[[l - 1 for l in layers]], full).mean()), 4)  # noqa: E741
            for n, v in sorted(directions.curve.items())}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    data = stage_params(__doc__, argv)
    llm_params, qa_params = load_section("llm", data=data), load_section("qa", data=data)
    params = load_section("extract_directions", data=data)
    statements = {c: load_statements(getattr(params, c).statements, qa_params.out) for c in CONCEPTS}  # fail early
    llm = load_llm(llm_params.dir, llm_params.dtype, llm_params.device)
    torch.manual_seed(params.seed)
    llm_ref = {"dir": llm_params.dir, "source": llm_params.source, "gguf_file": llm_params.gguf_file}
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
        directions.save(Path(params.out_dir) / concept)
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
    write_json(params.metrics, metrics)


if __name__ == "__main__":
    main()
