"""Cost of real-time hallucination scoring during generation.

What it measures
----------------
For the same article prompts (the build_realtime prompt over the prepared articles), greedy
continuations of ``--max-new-tokens`` tokens are generated three ways:

* **plain** -- ``model.generate`` alone;
* **ours** -- ``model.generate`` with the real-time detector's monitor attached (forward hooks catch
  the hidden states of the chosen layers during generation, the logits processor pairs them with
  the token's probability and entropy, and the MLP scores each token as it comes);
* **post-hoc** -- ``model.generate`` and then, as the released DioR code does, a second forward pass
  over prompt + continuation with ``output_hidden_states=True`` to compute the same features, scored
  by the same MLP.

The three produce the same tokens (checked), and ours and post-hoc the same per-token probabilities
(largest difference reported). ``ours/plain`` and ``posthoc/plain`` are ratios of total times (1.03 =
3 % overhead). Calls alternate between the three methods per prompt, after one warm-up, and with
``--repeats R`` each call is made R times keeping the fastest, so a burst of load on a busy machine
does not land on one method only. Timings are reported, never asserted.

The detector is the trained one in ``paths.realtime_model`` when it exists; otherwise an untrained
MLP of the same shape (the cost is the same).

Run: ``python -m benchmarks.realtime_overhead [--n-prompts N] [--max-new-tokens T] [--repeats R] [--out PATH]``
after the prepare, prepare_articles (and ideally train_realtime) stages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from detectors.config import load_section
from detectors.dior.entities import EntityTools, prepare_article
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.dior.recorder import eos_ids, token_features
from detectors.llm.layers import hidden_state_indices
from detectors.llm.loading import load_llm


def detector_for(llm, build, train, model_dir: str) -> RealtimeDetector:
    if (Path(model_dir) / "detector.json").exists():
        return RealtimeDetector.load(model_dir).attach(llm)
    indices = hidden_state_indices(build.hidden_layers, llm.fingerprint.num_layers, "build_realtime.hidden_layers")
    dim = len(indices) * llm.fingerprint.hidden_size + 3
    net = TokenMLP(dim, train.training.hidden, 0.0).eval()
    ones = np.ones(dim, np.float32)
    return RealtimeDetector(
        net,
        0 * ones,
        ones,
        0.5,
        build.hidden_layers,
        indices,
        build.prompt,
        build.spacy_model,
        llm.fingerprint,
        {"dtype": llm.dtype_name},
        {},
    ).attach(llm)


def timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--n-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/realtime_overhead.json")
    args = parser.parse_args(argv)
    llm_params, paths = load_section("llm", args.params), load_section("paths", args.params)
    build, train = load_section("build_realtime", args.params), load_section("train_realtime", args.params)
    llm = load_llm(paths.llm, llm_params.dtype, llm_params.device)
    detector = detector_for(llm, build, train, paths.realtime_model)
    tools = EntityTools(build.spacy_model, build.embedding_model)
    prompts = []
    for art in pd.read_parquet(paths.articles).itertuples():
        try:
            prompts.append(
                prepare_article(
                    tools,
                    llm,
                    art.id,
                    art.title,
                    art.text,
                    build.prompt,
                    max_new_tokens=build.max_new_tokens,
                    max_article_chars=build.max_article_chars,
                    prefix_sentences=build.prefix_sentences,
                    min_prefix_chars=build.min_prefix_chars,
                )[1]
            )
        except ValueError:
            continue
        if len(prompts) == args.n_prompts:
            break
    model, tok, n_new = llm.model, llm.tokenizer, args.max_new_tokens
    eos = eos_ids(llm)

    def plain(ids):
        return model.generate(ids, max_new_tokens=n_new, do_sample=False)[0, ids.shape[1] :].tolist()

    def ours(ids):
        with detector.monitor() as mon:
            model.generate(ids, logits_processor=[mon], max_new_tokens=n_new + 1, do_sample=False)
        trace = mon.traces(eos, limit=n_new)[0]
        return trace.gen_ids, trace.scores

    def posthoc(ids):
        gen = model.generate(ids, max_new_tokens=n_new, do_sample=False)[0, ids.shape[1] :].tolist()
        full = torch.tensor([ids[0].tolist() + gen], device=llm.device)
        out = model(full, output_hidden_states=True)
        p0 = ids.shape[1]
        hidden = torch.cat([out.hidden_states[p][0, p0 : p0 + len(gen)] for p in detector.state_indices], -1)
        logp = torch.log_softmax(out.logits[0, p0 - 1 : p0 - 1 + len(gen)].float(), -1)
        prob = logp[torch.arange(len(gen)), torch.tensor(gen)].exp()
        entropy = -(logp.exp() * logp).sum(-1)
        x = token_features(hidden.to(torch.float16).cpu().numpy(), prob.cpu().numpy(), entropy.cpu().numpy())
        return gen, detector.predict_proba(x)

    totals = {"plain": 0.0, "ours": 0.0, "posthoc": 0.0}
    same_tokens, max_diff = True, 0.0
    load_before = os.getloadavg()[0]
    with torch.no_grad():
        warm = tok(prompts[0], return_tensors="pt", add_special_tokens=not build.prompt.chat).input_ids.to(llm.device)
        plain(warm), ours(warm), posthoc(warm)
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt", add_special_tokens=not build.prompt.chat).input_ids.to(llm.device)
            t_plain, g_plain = timed(lambda: plain(ids), args.repeats)
            t_ours, (g_ours, s_ours) = timed(lambda: ours(ids), args.repeats)
            t_post, (g_post, s_post) = timed(lambda: posthoc(ids), args.repeats)
            totals["plain"] += t_plain
            totals["ours"] += t_ours
            totals["posthoc"] += t_post
            n = len(g_ours)
            same_tokens &= g_plain[:n] == g_ours == g_post[:n]
            max_diff = max(max_diff, float(np.abs(np.asarray(s_ours) - np.asarray(s_post)[:n]).max()) if n else 0.0)
    result = {
        "llm": llm.fingerprint.name,
        "device": str(llm.device),
        "prompts": len(prompts),
        "max_new_tokens": n_new,
        "repeats": args.repeats,
        "seconds": totals,
        "ours_over_plain": totals["ours"] / totals["plain"],
        "posthoc_over_plain": totals["posthoc"] / totals["plain"],
        "same_tokens": bool(same_tokens),
        "max_probability_diff_ours_vs_posthoc": max_diff,
        "load_before_after": [load_before, os.getloadavg()[0]],
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
