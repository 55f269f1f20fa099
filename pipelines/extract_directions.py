"""Stage extract_directions: CtrlA honesty and confidence directions (§3.2.1) from contrast pairs, per layer.

Writes ``<out_dir>/honesty`` and ``<out_dir>/confidence`` (safetensors + detector.json with the layer
indices, the LLM fingerprint and the dtype they were extracted in) and a metrics JSON: explained variance
per layer and how close directions fitted on fewer statements come to the full one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import numpy as np
import torch

from detectors.ctrla.directions import extract
from detectors.ctrla.layer_ranges import resolve_range
from detectors.ctrla.statements import load_statements
from detectors.execution import LLMSpec, map_units
from detectors.io import write_json
from detectors.llm.loading import prepared_reference
from pipelines._stage import run, stage_params

log = logging.getLogger("extract_directions")
READS = (
    "llm",
    "extract_directions",
    "execution",
    "paths.llm",
    "paths.qa",
    "paths.directions",
    "paths.extract_directions_metrics",
)
DEPS = (
    "${paths.llm}",
    "${paths.qa}",
)
OUTS = (
    "${paths.directions}",
    ("${paths.extract_directions_metrics}", {"cache": False}),
)
CONCEPTS = ("honesty", "confidence")


def curve_similarity(directions, layers: list[int]) -> dict[str, float]:
    """Mean |cosine| at ``layers`` between the directions fitted on n statements and on all of them."""
    full = directions.at(layers)
    return {
        str(n): round(float(torch.nn.functional.cosine_similarity(v[[l - 1 for l in layers]], full).mean()), 4)  # noqa: E741
        for n, v in sorted(directions.curve.items())
    }


class ConceptWorker:
    """Extracts one concept's directions per call and saves them under ``out``; loads the LLM once (in the stage's
    process or a Ray actor, so that honesty and confidence can be extracted side by side)."""

    def __init__(self, llm: LLMSpec, params, statements: dict, out: str):
        self.llm, self.params, self.statements, self.out = llm.load(), params, statements, Path(out)
        torch.manual_seed(params.seed)
        _, self.llm_ref = prepared_reference(llm.location)  # extract() adds the dtype the directions are extracted in
        n_layers = self.llm.fingerprint.num_layers
        self.layers = {
            "honesty": resolve_range(params.steering.layers, n_layers),
            "confidence": resolve_range(params.monitor.layers, n_layers),
        }

    def __call__(self, concept: str) -> dict:
        start, params = time.time(), self.params
        contrast = getattr(params, concept)
        config = {
            "llm": self.llm_ref,
            "instructions": {"positive": contrast.positive, "negative": contrast.negative, "chat": contrast.chat},
            "statements": dataclasses.asdict(contrast.statements),
            "steering": dataclasses.asdict(params.steering),
            "monitor": dataclasses.asdict(params.monitor),
            "seed": params.seed,
        }
        layers = self.layers[concept]
        directions, _ = extract(
            self.llm,
            concept,
            contrast,
            self.statements[concept],
            layers,
            params.batch_size,
            params.seed,
            params.size_curve,
            config,
        )
        directions.save(self.out / concept)
        ev = directions.explained_variance.numpy()
        chosen = np.array(layers) - 1
        metrics = {
            "n_statements": directions.config["n_statements"],
            "n_tokens": directions.config["n_tokens"],
            "layers": layers,
            "explained_variance_chosen": round(float(ev[chosen].mean()), 4),
            "explained_variance_per_layer": [round(float(x), 4) for x in ev],
            "size_curve_cosine": curve_similarity(directions, layers),
            "seconds": round(time.time() - start, 1),
        }
        log.info("%s: %s", concept, {k: v for k, v in metrics.items() if k != "explained_variance_per_layer"})
        return metrics


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "extract_directions")
    directions = params["extract_directions"]
    # fail early
    statements = {c: load_statements(getattr(directions, c).statements, params["paths.qa"]) for c in CONCEPTS}
    worker = functools.partial(ConceptWorker, LLMSpec.of(params), directions, statements, params["paths.directions"])
    metrics = {CONCEPTS[i]: result for i, result in map_units(CONCEPTS, worker, params["execution"])}
    write_json(params["paths.extract_directions_metrics"], {c: metrics[c] for c in CONCEPTS})


if __name__ == "__main__":
    run(main)
