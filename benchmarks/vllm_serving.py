"""The registered real-time detector inside vLLM: parity with the Hugging Face path, and what it costs.

What it measures
----------------
On the prepared LLM (``data/llm``: SmolLM2-135M-Instruct by default), with detectors of the served kinds registered in a
temporary MLflow store (random weights at the LLM's shape, :mod:`benchmarks.vllm_detectors`: the pipeline's trained
ones are used the same way, and a detector's cost and parity do not depend on its weights):

* **parity**: the QA fixture's questions, greedy, ``--max-new-tokens`` tokens, in one vLLM batch with
  ``extra_args={"detector": "dior-realtime"}`` and through the project's Hugging Face path one question at a time
  (``generate_traced`` with the detector's ``score_tokens``, what ``load_detector(...).generate`` runs); how many
  continuations have the same
  tokens, and the largest difference of the per-token scores over the tokens both generated (the prefix before a
  continuation diverges, where they diverge); the same for ``ctrla-confidence``'s Eq. 2 against the monitor on the
  shared decoder;
* **throughput** at batch 1, 8 and 32 (``--batches``): generated tokens per second of vLLM without a detector
  (``plain``), of vLLM with the real-time detector on every request (``detector``), of the project's Hugging Face path
  with the same detector (``hf``, batched by its decoder), and of one question at a time through ``model.generate``
  with the detector's monitor (``generate_1``: how the seed papers' released code runs, batch-independent). vLLM rows
  generate exactly ``--max-new-tokens`` tokens (``ignore_eos``); the Hugging Face rows count the tokens they generated.
  Each method runs ``--repeats`` times, alternating, keeping the fastest. Ratios are of times per generated token in
  one run: ``detector/plain`` is the detector's overhead in vLLM (target <= 1.10 at batch 32).

Timings are reported, never asserted. ``--device cuda`` runs the same on a GPU (the ``vllm`` package there);
``--dtype`` sets the LLM's dtype in both engines (default bfloat16, what the detectors are served in).

Run: ``python -m benchmarks.vllm_serving [--llm data/llm] [--device cpu] [--dtype bfloat16] [--parity-only]
[--out PATH]`` (needs vLLM, which ``make setup`` installs, and ``data/llm`` from ``dvc repro prepare``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import vllm_detectors
from detectors import load_detector
from detectors.ctrla.monitor import generate_segment
from detectors.dior.recorder import generate_traced
from detectors.llm.loading import load_llm, prepared_reference
from detectors.serving.vllm_cli import KEEP_FREED

QA = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "qa_small.jsonl"


def prompts(n: int) -> list[str]:
    rows = [json.loads(line)["question"] for line in QA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [rows[i % len(rows)] for i in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parity(engine, llm, uri: str, texts: list[str], n_tokens: int) -> dict:
    """vLLM's tokens and scores against the Hugging Face path's on the same prompts."""
    from vllm import SamplingParams

    out = {}
    realtime = load_detector("dior-realtime", tracking_uri=uri, llm=llm)
    confidence = load_detector("ctrla-confidence", tracking_uri=uri, llm=llm)
    eos = llm.eos_token_ids | {llm.tokenizer.pad_token_id}
    for name in ("dior-realtime", "ctrla-confidence"):
        params = SamplingParams(max_tokens=n_tokens, temperature=0, extra_args={"detector": name})
        served = [o.outputs[0] for o in engine.generate(texts, params, use_tqdm=False)]
        scorer = realtime.score_tokens
        if name == "dior-realtime":  # one prompt at a time: in bfloat16 a padded batch rounds otherwise
            reference = []
            for text in texts:
                (trace,) = generate_traced(llm, [text], realtime.state_indices, n_tokens, False, scorer)[1]
                reference.append((trace.gen_ids, trace.scores.tolist()))
        else:
            reference = []
            for text in texts:
                ids = torch.tensor([llm.tokenizer(text)["input_ids"]], device=llm.device)
                segment = generate_segment(llm, ids, n_tokens, monitor=confidence.monitor())
                reference.append((segment.token_ids, segment.scores))
        same, diffs, compared = 0, [], 0
        for completion, (ids, scores) in zip(served, reference):
            tokens = [t for t in completion.token_ids if t not in eos]
            same += tokens == ids
            k = common_prefix(tokens, ids)
            pairs = [(a, b) for a, b in zip(completion.dynrag["scores"][:k], scores[:k]) if a is not None]
            diffs += [abs(a - b) for a, b in pairs]
            compared += len(pairs)
        out[name] = {
            "continuations": len(texts),
            "same_tokens": same,
            "scored_tokens_compared": compared,
            "max_abs_score_difference": float(max(diffs)) if diffs else None,
            "mean_abs_score_difference": float(np.mean(diffs)) if diffs else None,
        }
    return out


def throughput(engine, llm, uri: str, batches: list[int], n_tokens: int, repeats: int) -> dict:
    """Generated tokens per second of each method at each batch size (fastest of ``repeats``, methods alternating)."""
    from vllm import SamplingParams

    realtime = load_detector("dior-realtime", tracking_uri=uri, llm=llm)
    model, tok = llm.model, llm.tokenizer

    def vllm_run(texts, detector):
        extra = {"detector": "dior-realtime"} if detector else None
        params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        return sum(len(o.outputs[0].token_ids) for o in engine.generate(texts, params, use_tqdm=False))

    def hf_run(texts):
        traces = generate_traced(llm, texts, realtime.state_indices, n_tokens, False, realtime.score_tokens)[1]
        return sum(len(t.gen_ids) for t in traces)

    def generate_one_at_a_time(texts):
        n = 0
        for text in texts:
            enc = tok(text, return_tensors="pt").to(model.device)
            with torch.no_grad(), realtime.monitor() as mon:
                out = model.generate(**enc, max_new_tokens=n_tokens, do_sample=False, logits_processor=[mon])
            n += out.shape[1] - enc["input_ids"].shape[1]
        return n

    methods = {
        "plain": lambda t: vllm_run(t, False),
        "detector": lambda t: vllm_run(t, True),
        "hf": hf_run,
    }
    rows = {}
    texts_all = prompts(max(batches))
    for batch in batches:
        texts = texts_all[:batch]
        for fn in methods.values():  # warm-up
            fn(texts[:1])
        best = {name: (float("inf"), 0) for name in methods}
        for _ in range(repeats):
            for name, fn in methods.items():
                start = time.perf_counter()
                tokens = fn(texts)
                elapsed = time.perf_counter() - start
                if elapsed < best[name][0]:
                    best[name] = (elapsed, tokens)
        rows[batch] = {name: {"seconds": s, "tokens": n, "tokens_per_s": n / s} for name, (s, n) in best.items()}
    one = texts_all[: min(8, len(texts_all))]
    generate_one_at_a_time(one[:1])
    start = time.perf_counter()
    n = generate_one_at_a_time(one)
    single = {"seconds": time.perf_counter() - start, "tokens": n, "questions": len(one)}
    single["tokens_per_s"] = n / single["seconds"]
    for row in rows.values():
        per_token = {name: 1 / v["tokens_per_s"] for name, v in row.items()}
        row["ratios"] = {
            "detector/plain": per_token["detector"] / per_token["plain"],
            "hf/detector": per_token["hf"] / per_token["detector"],
            "generate_1/detector": (1 / single["tokens_per_s"]) / per_token["detector"],
        }
    return {"batches": rows, "generate_1": single}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default="data/llm", help="the prepared LLM (dvc repro prepare)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE on a CPU")
    parser.add_argument("--parity-only", action="store_true", help="leave out the throughput")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/vllm_serving_<device>.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)

    llm = load_llm(args.llm, args.dtype, args.device)
    fingerprint, ref = prepared_reference(args.llm)
    ref["dtype"] = llm.dtype_name
    detectors = vllm_detectors.served_kinds(fingerprint, ref, threshold=1.0)  # never fires: every token generates
    with tempfile.TemporaryDirectory() as store:
        uri = vllm_detectors.register(detectors, store)
        os.environ["MLFLOW_TRACKING_URI"] = uri
        from vllm import LLM

        start = time.perf_counter()
        engine = LLM(model=args.llm, dtype=args.dtype, max_num_seqs=max(args.batches), max_model_len=512, seed=0)
        built = time.perf_counter() - start
        result = {
            "llm": fingerprint.name,
            "dtype": args.dtype,
            "device": args.device,
            "detectors": "random weights at the LLM's shape (benchmarks/vllm_detectors.py), registered in a temporary "
            "MLflow store",
            "realtime_layers": detectors["dior-realtime"].hidden_layers,
            "max_new_tokens": args.max_new_tokens,
            "engine_build_s": built,
            "parity": parity(engine, llm, uri, prompts(max(args.batches)), args.max_new_tokens),
            "throughput": None
            if args.parity_only
            else throughput(engine, llm, uri, args.batches, args.max_new_tokens, args.repeats),
            # the allocator: the detector's statistics allocate full-vocabulary buffers each step, which glibc's
            # defaults hand back to the kernel and fault in again (docs/serving.md)
            "allocator": {k: os.environ.get(k) for k in ("LD_PRELOAD", *KEEP_FREED)},
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "date": time.strftime("%Y-%m-%d"),
        }
        engine.llm_engine.engine_core.shutdown()
    name = f"vllm_parity_{args.dtype}" if args.parity_only else "vllm_serving"
    out = Path(args.out or f"benchmarks/results/{name}_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
