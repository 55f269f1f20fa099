"""Speed and agreement of our per-question Integrated-Gradients attribution against a DioR-style reference,
on the real prepared LLM. (``benchmarks.throughput`` splits the gain by cause: batch size, prefix caching,
batching across questions, with random-weight models of the default and a 7B shape.)

What it measures
----------------
For the same factual completion prompts, the same target token (argmax of the next-token
distribution), the same ``n_steps``, integration method and baseline (input embeddings with the
question positions zeroed), it times two implementations of the per-question-token attribution:

* **ours** -- :func:`detectors.dior.attribution.token_attributions` with ``batch_size=n_steps``: all
  interpolation steps go through the model in one batch, the forward only computes the last
  position's logits (``logits_to_keep=1``), and the prompt before the question runs once (its
  key/value cache is shared by all steps).
* **reference** -- written here in the style of the released DioR code: captum ``IntegratedGradients``
  whose forward runs the full model on ``inputs_embeds`` (logits for every position), takes a softmax
  over the full vocabulary of the whole logits tensor and returns the target token's probability at
  the last position; ``internal_batch_size=4``.

Both per-token scores are the L2 norm over the embedding dimension of the attribution at the question
positions, then normalised with :func:`detectors.attribution.attribution_distribution`.

How to read it
--------------
``speed ratio`` is total reference time / total ours time: above 1 means ours is faster. Each method
is warmed up once on the first question, then every question (the first included) is timed with
``time.perf_counter`` around one call; target selection and prompt encoding are not timed. With
``--repeats R`` each call is made R times (ours and reference alternating) and the fastest is kept,
which makes the totals robust to other programs on a busy machine. ``median ratio`` is the median of
the per-question ratios, also robust to a burst of load hitting a few calls; ``load`` is the 1-minute
load average before and after the run (well above the number of cores means the timings are noisy).
``max |dp|`` is the largest absolute difference between the two attribution distributions over all
question tokens of all questions, ``max |dH|`` the largest difference of their entropies
(:func:`detectors.attribution.attribution_entropy`). The two compute the same mathematical quantity,
so these should be at floating-point noise level (batching changes the order of float reductions);
anything larger means the implementations disagree. Timings depend on the machine and its load and
are reported, never asserted.

The prompt is the pipeline's own (``build_early.features.prompt`` in params.yaml: a few-shot prefix
before the question by default); ``--prompt plain`` puts the bare question to the model instead.

Run: ``python -m benchmarks.ig_speed [--prompt params|plain] [--n-questions N] [--n-steps S] [--llm DIR] [--out PATH]``
after the prepare stage (``make bench`` does both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from itertools import cycle, islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from captum.attr import IntegratedGradients
from transformers import PreTrainedModel

from detectors.config import load_section
from detectors.config.schema import PromptParams
from detectors.dior.attribution import attribution_distribution, attribution_entropy, token_attributions
from detectors.llm.loading import LLM, load_llm

DEFAULT_OUT = "benchmarks/results/ig_speed.json"
METHOD = "gausslegendre"
REFERENCE_BATCH_SIZE = 4
PLAIN = PromptParams(template="{question}", chat=False)

QUESTIONS: list[str] = [
    "The capital of Occitania is",
    "The country of citizenship of Ana Brenda Contreras is",
    "The author of the novel One Hundred Years of Solitude is",
    "The chemical symbol of the element gold is",
    "The director of the film Pan's Labyrinth is",
    "The longest river in South America is the",
    "The composer of the opera The Magic Flute is",
    "The official language of the Faroe Islands is",
    "The mother of the painter Frida Kahlo was born in",
    "The headquarters of the European Central Bank are in the city of",
    "The inventor of the phonograph is",
    "The highest mountain in the Alps is",
]


def reference_forward(model: PreTrainedModel, target_id: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """DioR-style forward: full logits for every position, softmax over all of them, last position's target."""

    def forward(inputs_embeds: torch.Tensor) -> torch.Tensor:
        outputs = model(inputs_embeds=inputs_embeds)
        probs = torch.softmax(outputs.logits, dim=-1)
        return probs[:, -1, target_id]

    return forward


def reference_token_attributions(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    question_mask: torch.Tensor,
    target_id: int,
    n_steps: int,
    method: str = METHOD,
    batch_size: int = REFERENCE_BATCH_SIZE,
) -> np.ndarray:
    """The reference attribution: same baseline and per-token reduction as ``token_attributions``."""
    embeds = model.get_input_embeddings()(input_ids).detach()
    baseline = embeds * (~question_mask)[None, :, None].to(embeds.dtype)
    ig = IntegratedGradients(reference_forward(model, target_id))
    attr = ig.attribute(embeds, baselines=baseline, n_steps=n_steps, method=method, internal_batch_size=batch_size)
    scores = attr[0].float().norm(dim=-1)[question_mask]
    return scores.detach().cpu().numpy()


def ours(llm: LLM, ids: torch.Tensor, mask: torch.Tensor, target: int, n_steps: int) -> np.ndarray:
    return token_attributions(llm.model, ids, mask, target, n_steps, method=METHOD, batch_size=n_steps)


def reference(llm: LLM, ids: torch.Tensor, mask: torch.Tensor, target: int, n_steps: int) -> np.ndarray:
    return reference_token_attributions(llm.model, ids, mask, target, n_steps)


def next_token(llm: LLM, ids: torch.Tensor) -> int:
    """Argmax of the next-token distribution after the prompt."""
    with torch.no_grad():
        logits = llm.model(input_ids=ids, logits_to_keep=1, use_cache=False).logits[0, -1]
    return int(logits.argmax())


def timed(fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(llm: LLM, questions: list[str], n_steps: int, prompt: PromptParams, repeats: int = 1) -> dict[str, Any]:
    encoded = [llm.encode_prompt(q, prompt) for q in questions]
    targets = [next_token(llm, ids) for ids, _ in encoded]

    ids0, mask0 = encoded[0]
    ours(llm, ids0, mask0, targets[0], n_steps)  # warm-up
    reference(llm, ids0, mask0, targets[0], n_steps)  # warm-up

    rows: list[dict[str, Any]] = []
    for question, (ids, mask), target in zip(questions, encoded, targets):
        t_ours = t_ref = float("inf")
        for _ in range(repeats):
            s_ours, t = timed(lambda: ours(llm, ids, mask, target, n_steps))
            t_ours = min(t_ours, t)
            s_ref, t = timed(lambda: reference(llm, ids, mask, target, n_steps))
            t_ref = min(t_ref, t)
        p_ours, p_ref = attribution_distribution(s_ours), attribution_distribution(s_ref)
        rows.append(
            {
                "question": question,
                "target": llm.tokenizer.decode([target]),
                "prompt_tokens": int(ids.shape[1]),
                "question_tokens": int(mask.sum()),
                "time_ours_s": t_ours,
                "time_reference_s": t_ref,
                "max_abs_diff_distribution": float(np.max(np.abs(p_ours - p_ref))),
                "abs_diff_entropy": abs(attribution_entropy(p_ours) - attribution_entropy(p_ref)),
                "max_rel_diff_scores": float(np.max(np.abs(s_ours - s_ref) / np.maximum(np.abs(s_ref), 1e-12))),
            }
        )

    total_ours = sum(r["time_ours_s"] for r in rows)
    total_ref = sum(r["time_reference_s"] for r in rows)
    return {
        "n_questions": len(questions),
        "n_steps": n_steps,
        "method": METHOD,
        "ours_batch_size": n_steps,
        "reference_batch_size": REFERENCE_BATCH_SIZE,
        "repeats": repeats,
        "total_time_ours_s": total_ours,
        "total_time_reference_s": total_ref,
        "speed_ratio_reference_over_ours": total_ref / total_ours,
        "median_speed_ratio_per_question": float(np.median([r["time_reference_s"] / r["time_ours_s"] for r in rows])),
        "max_abs_diff_distribution": max(r["max_abs_diff_distribution"] for r in rows),
        "max_abs_diff_entropy": max(r["abs_diff_entropy"] for r in rows),
        "max_rel_diff_scores": max(r["max_rel_diff_scores"] for r in rows),
        "questions": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'question':<58} {'target':>10} {'tok':>4} {'ours s':>8} {'ref s':>8} {'ratio':>6} {'max|dp|':>9} {'|dH|':>9}"
    )
    for r in result["questions"]:
        q = r["question"] if len(r["question"]) <= 58 else r["question"][:55] + "..."
        print(
            f"{q:<58} {r['target']!r:>10} {r['prompt_tokens']:>4} "
            f"{r['time_ours_s']:>8.3f} {r['time_reference_s']:>8.3f} "
            f"{r['time_reference_s'] / r['time_ours_s']:>6.2f} {r['max_abs_diff_distribution']:>9.2e} "
            f"{r['abs_diff_entropy']:>9.2e}"
        )
    print()
    print(
        f"prompt={result['prompt']}  n_questions={result['n_questions']}  n_steps={result['n_steps']}  "
        f"method={result['method']}  "
        f"repeats={result['repeats']}  threads={result['torch_threads']}  device={result['device']}  "
        f"load={result['load_before']:.1f}->{result['load_after']:.1f} on {result['cpu_count']} cpus"
    )
    print(f"{'total ours (s)':<28} {result['total_time_ours_s']:.3f}")
    print(f"{'total reference (s)':<28} {result['total_time_reference_s']:.3f}")
    print(f"{'speed ratio (ref / ours)':<28} {result['speed_ratio_reference_over_ours']:.2f}")
    print(f"{'median ratio per question':<28} {result['median_speed_ratio_per_question']:.2f}")
    print(f"{'max |dp| (distribution)':<28} {result['max_abs_diff_distribution']:.2e}")
    print(f"{'max |dH| (entropy)':<28} {result['max_abs_diff_entropy']:.2e}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--n-questions", type=int, default=8, help="first N built-in questions, cycling past the list (default 8)"
    )
    parser.add_argument("--n-steps", type=int, default=16, help="IG interpolation steps (default 16)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="time each call this many times, keep the fastest (default 1)"
    )
    parser.add_argument(
        "--llm",
        default=None,
        help="prepared LLM directory (default: paths.llm of params.yaml; run the prepare stage first)",
    )
    parser.add_argument(
        "--prompt",
        choices=["params", "plain"],
        default="params",
        help="the pipeline's prompt (default) or the bare question",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if min(args.n_questions, args.n_steps, args.repeats) < 1:
        parser.error("--n-questions, --n-steps and --repeats must be positive")

    args.llm = args.llm or load_section("paths").llm
    if not Path(args.llm).exists():
        parser.error(f"LLM directory {args.llm!r} does not exist: run `dvc repro prepare` first (make bench does)")
    llm = load_llm(args.llm)
    prompt = load_section("build_early").features.prompt if args.prompt == "params" else PLAIN
    questions = list(islice(cycle(QUESTIONS), args.n_questions))
    load_before = os.getloadavg()[0]
    result = run(llm, questions, args.n_steps, prompt, args.repeats)
    result.update(
        prompt=args.prompt,
        prompt_template=prompt.template,
        llm=args.llm,
        llm_name=llm.fingerprint.name,
        device=str(llm.device),
        dtype=str(next(llm.model.parameters()).dtype),
        torch_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        load_before=load_before,
        load_after=os.getloadavg()[0],
        torch_version=torch.__version__,
        machine=platform.machine(),
    )
    print_table(result)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
