"""Cost of CtrlA at generation time: greedy generation with honesty steering and the confidence monitor
attached vs plain greedy generation, same prompts, same number of tokens, same run.

Prints and writes the ratio of wall times (steered + monitored / plain); the hooks add a vector and a
dot product per monitored layer and token, so the ratio should be a few percent above 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from detectors.config import load_section
from detectors.ctrla.registered import ConfidenceDetector, HonestySteering
from detectors.io import write_json
from detectors.llm.loading import load_llm

PROMPTS = [
    "Who wrote the novel Moby-Dick?",
    "What is the capital of Australia?",
    "How does a telescope work?",
    "When did the Berlin Wall fall?",
    "What causes the seasons on Earth?",
    "Who painted the Mona Lisa?",
]


def _generate(llm, ids, n: int):
    eos = llm.model.generation_config.eos_token_id
    llm.model.generation_config.eos_token_id = None  # same length every time: no early stop
    try:
        return llm.model.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=llm.tokenizer.pad_token_id,
            attention_mask=torch.ones_like(ids),
        )
    finally:
        llm.model.generation_config.eos_token_id = eos


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/ctrla_overhead.json")
    args = parser.parse_args(argv)
    llm_params, paths = load_section("llm", args.params), load_section("paths", args.params)
    llm = load_llm(paths.llm, llm_params.dtype, llm_params.device)
    honesty = HonestySteering.load(Path(paths.directions) / "honesty").attach(llm)
    confidence = ConfidenceDetector.load(Path(paths.directions) / "confidence").attach(llm)
    prompts = [llm.encode_prompt(p, confidence.params.prompt)[0] for p in PROMPTS]  # the served monitor prompt
    _generate(llm, prompts[0], 4)  # warm-up
    plain, ctrla = [], []
    for _ in range(args.repeats):  # interleaved so drifts in machine load hit both alike
        for ids in prompts:
            start = time.perf_counter()
            with torch.no_grad():
                _generate(llm, ids, args.tokens)
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch.no_grad(), honesty.steer(), confidence.monitor() as monitor:
                _generate(llm, ids, args.tokens)
            monitor.scores()
            ctrla.append(time.perf_counter() - start)
    ratio = sum(ctrla) / sum(plain)
    result = {
        "device": str(llm.device),
        "llm": llm.fingerprint.name,
        "prompts": len(prompts),
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "steering_layers": honesty.directions.layers,
        "monitor_layers": confidence.directions.layers,
        "plain_s_median": round(statistics.median(plain), 4),
        "ctrla_s_median": round(statistics.median(ctrla), 4),
        "ratio": round(ratio, 4),
        "ratio_of_medians": round(statistics.median(ctrla) / statistics.median(plain), 4),
    }
    write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
