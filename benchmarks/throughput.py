"""Throughput of the build workers and of monitored generation, with random-weight models (no downloads).

What it measures
----------------
For each ``--shape`` (the default LLM's, SmolLM2-135M, and a Llama-2-7B shape) it builds a Llama with
random weights (bf16 on a GPU, fp32 on a CPU) and the tokenizer of ``paths.llm`` (so the 7B shape has
that tokenizer's vocabulary, 49,152 rows instead of Llama-2's 32,000), and reports:

* **IG, s/question** at ``--n-steps`` with the pipeline's prompt, four ways, so each gain has its cause:
  ``reference_b4`` (DioR-style: captum over the whole prompt, logits of every position, 4 steps per
  pass), ``reference_bN`` (the same with all N steps per pass: the batch-size gain),
  ``per_question`` (the pre-issue-12 code: captum per question, the prompt before the question run
  once per question as a key/value cache, last-position logits only: the caching gain) and
  ``batched`` (:func:`detectors.dior.attribution.batch_token_attributions`: the prompt prefix once, the
  steps of many questions per pass: the batching gain). ``max_abs_dp_batched_vs_per_question`` is the
  largest difference of the attribution distributions. ``achieved_tflops`` counts 4 x the non-embedding
  parameters per integrated token (forward + input gradient; no weight gradient), next to the card's peak.
* **Build workers, examples/s**: build_early's (``early_records``: features, IG and greedy answers of a
  batch of questions) and build_realtime's (``generate_traced``: continuations of ``--max-new-tokens``
  with every token's hidden states captured; the spaCy labelling is CPU work outside the LLM).
* **Generation with a monitor attached vs plain**, at batch 1 and 16 (``--max-new-tokens``, no early
  stop): the real-time recorder with an MLP scorer (a random ``TokenMLP`` of the served shape) and
  CtrlA's honesty steering + confidence monitor (random unit directions). Ratios of the fastest times, the median
  and quartiles of each round's paired ratio (variant over the same round's plain call), and the tensor
  operations each dispatches per generated token (what bounds a step at batch 1 on a GPU, counted the same on any
  device).
* **The RAG loop**, s/question: the questions advanced together (``batch_size`` 16) against one at a time
  (batch 1), with DRAGIN's RIND trigger over a BM25 index of 16 one-sentence passages, its threshold the
  median of the no-retrieval answers' positive RIND scores (RIND is 0 on stop words), at most 2 retrievals;
  and how many answers and retrieval traces the two give alike (bf16 batches of other sizes may round apart).

Calls alternate between the variants and each is timed ``--repeats`` times keeping the fastest; on a
GPU every timing synchronises first. Timings are reported, never asserted.

Run: ``python -m benchmarks.throughput [--shape smollm2-135m llama2-7b] [--device cuda] [--out PATH]``
after the prepare stage (the tokenizer; or ``--tokenizer DIR`` where only its files are at hand). On the CPU the
default is the small shape only.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np
import torch
from captum.attr import IntegratedGradients
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from benchmarks.ig_speed import QUESTIONS, reference_token_attributions
from detectors.config import load_section
from detectors.ctrla.directions import Directions
from detectors.ctrla.monitor import ConfidenceMonitor
from detectors.ctrla.steering import steer
from detectors.dior.attribution import IGItem, attribution_distribution, batch_token_attributions
from detectors.dior.early import early_records
from detectors.dior.nets import TokenMLP
from detectors.dior.realtime_detector import RealtimeDetector
from detectors.dior.recorder import generate_traced
from detectors.io import write_json
from detectors.llm.kv import prefix_kv, shared_prefix_length
from detectors.llm.layers import hidden_state_indices
from detectors.llm.loading import LLM
from detectors.rag.corpus import Passage
from detectors.rag.families import make_trigger
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.retriever import BM25Retriever

SHAPES = {  # config.json of HuggingFaceTB/SmolLM2-135M and meta-llama/Llama-2-7b-hf (vocabulary: the tokenizer's)
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
    ),
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    ),
}
SECTIONS = ("ig", "workers", "monitors", "rag_loop")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16 tensor-core peak (SXM)
ARTICLE = (
    "Below is the opening sentence from a Wikipedia article titled {t}. Please continue the passage from where the "
    "sentence ends.\n\n{t} is a city in the north of the country, known for its"
)
TITLES = [
    "Occitania",
    "Toulouse",
    "Kenya",
    "Nairobi",
    "Bolt",
    "Cairo",
    "Faroe Islands",
    "Lima",
    "Peru",
    "Madrid",
    "Sevilla",
    "Bergen",
    "Oslo",
    "Kyoto",
    "Osaka",
    "Quito",
]


def random_llm(shape: str, tokenizer, device: str, dtype: torch.dtype, seed: int = 0) -> LLM:
    config = LlamaConfig(vocab_size=len(tokenizer), rms_norm_eps=1e-5, **SHAPES[shape])
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None  # random weights: no early end, every row generates all tokens
    return LLM.wrap(model, tokenizer, f"random-{shape}")


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def captum_per_question(llm: LLM, ids: torch.Tensor, mask: torch.Tensor, target: int, n_steps: int) -> np.ndarray:
    """The per-question code before batching: captum, the prompt prefix cached per question, last-position logits."""
    from detectors.llm.kv import as_cache

    start = int(mask.nonzero()[0, 0])
    prefix = prefix_kv(llm.model, ids, start)

    def forward(inputs_embeds: torch.Tensor) -> torch.Tensor:
        cache = as_cache(prefix, inputs_embeds.shape[0], llm.model.config)
        logits = llm.model(
            inputs_embeds=inputs_embeds, past_key_values=cache, logits_to_keep=1, use_cache=cache is not None
        ).logits
        return torch.softmax(logits[:, -1].float(), dim=-1)[:, target]

    embeds = llm.model.get_input_embeddings()(ids[:, start:]).detach()
    baseline = embeds * (~mask[start:])[None, :, None].to(embeds.dtype)
    attr = IntegratedGradients(forward).attribute(
        embeds, baselines=baseline, n_steps=n_steps, method="gausslegendre", internal_batch_size=n_steps
    )
    return attr[0].float().norm(dim=-1)[mask[start:]].detach().cpu().numpy()


def ig_section(llm: LLM, prompt, n_questions: int, n_steps: int, repeats: int, peak: float | None) -> dict:
    questions = (QUESTIONS * (n_questions // len(QUESTIONS) + 1))[:n_questions]
    enc = [llm.encode_prompt(q, prompt) for q in questions]
    with torch.no_grad():
        targets = [int(llm.model(ids, logits_to_keep=1).logits[0, -1].argmax()) for ids, _ in enc]
    ids_lists = [ids[0].tolist() for ids, _ in enc]
    common = min(shared_prefix_length(ids_lists), *(int(m.nonzero()[0, 0]) for _, m in enc))
    dev = llm.device

    def batched():
        prefix = prefix_kv(llm.model, enc[0][0], common)
        items = [IGItem(ids[0, common:], m[common:], t) for (ids, m), t in zip(enc, targets)]
        return batch_token_attributions(llm.model, items, n_steps, prefix=prefix)

    def per_question():
        return [captum_per_question(llm, ids, m, t, n_steps) for (ids, m), t in zip(enc, targets)]

    def reference(batch: int):
        return lambda: [
            reference_token_attributions(llm.model, ids, m, t, n_steps, batch_size=batch)
            for (ids, m), t in zip(enc, targets)
        ]

    batched()  # warm-up (allocator, kernels)
    t = {}
    t["batched"], ours = timed(batched, dev, repeats)
    t["per_question"], theirs = timed(per_question, dev, repeats)
    t["reference_bN"], _ = timed(reference(n_steps), dev, max(1, repeats - 1))
    t["reference_b4"], _ = timed(reference(4), dev, max(1, repeats - 1))
    dp = max(
        float(np.abs(attribution_distribution(a) - attribution_distribution(b)).max()) for a, b in zip(ours, theirs)
    )
    n_params = sum(p.numel() for n, p in llm.model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    tokens = sum(int(m[common:].shape[0]) for _, m in enc) * n_steps
    tflops = 4 * n_params * tokens / t["batched"] / 1e12
    per_q = {k: round(v / n_questions, 5) for k, v in t.items()}
    return {
        "questions": n_questions,
        "n_steps": n_steps,
        "shared_prefix_tokens": common,
        "s_per_question": per_q,
        "speedup_batched_vs_per_question": round(t["per_question"] / t["batched"], 2),
        "speedup_batched_vs_reference_b4": round(t["reference_b4"] / t["batched"], 2),
        "speedup_reference_bN_vs_b4": round(t["reference_b4"] / t["reference_bN"], 2),
        "speedup_per_question_vs_reference_bN": round(t["reference_bN"] / t["per_question"], 2),
        "max_abs_dp_batched_vs_per_question": dp,
        "achieved_tflops": round(tflops, 3),
        "peak_tflops": peak,
    }


def worker_section(llm: LLM, features, n_questions: int, max_new_tokens: int, repeats: int) -> dict:
    questions = (QUESTIONS * (n_questions // len(QUESTIONS) + 1))[:n_questions]
    early_s, _ = timed(
        lambda: early_records(llm, questions, [["x"]] * len(questions), features, 8, ["\n"]), llm.device, repeats
    )
    prompts = [ARTICLE.format(t=t) for t in TITLES]
    state = hidden_state_indices([10, 20, -1], llm.fingerprint.num_layers, "layers")
    rt_s, _ = timed(lambda: generate_traced(llm, prompts, state, max_new_tokens, False), llm.device, repeats)
    return {
        "build_early_questions_per_s": round(len(questions) / early_s, 2),
        "build_realtime_continuations_per_s": round(len(prompts) / rt_s, 2),
        "realtime_batch": len(prompts),
        "realtime_new_tokens": max_new_tokens,
    }


def monitor_section(llm: LLM, max_new_tokens: int, repeats: int) -> dict:
    fp, dev = llm.fingerprint, llm.device
    state = hidden_state_indices([10, 20, -1], fp.num_layers, "layers")
    width = len(state) * fp.hidden_size + 3
    detector = RealtimeDetector(
        net=TokenMLP(width).eval(),
        mean=np.zeros(width, np.float32),
        std=np.ones(width, np.float32),
        threshold=2.0,
        hidden_layers=[10, 20, -1],
        state_indices=state,
        prompt=None,
        spacy_model="",
        fingerprint=fp,
        llm_ref={"dtype": llm.dtype_name},
        info={},
    ).attach(llm)
    vectors = torch.nn.functional.normalize(
        torch.randn(fp.num_layers, fp.hidden_size, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    directions = Directions(
        "confidence",
        vectors,
        torch.zeros(fp.num_layers),
        torch.ones(fp.num_layers),
        list(range(1, fp.num_layers + 1)),
        fp,
        {},
    )
    steering = {layer: 0.05 * vectors[layer - 1].to(dev) for layer in range(fp.num_layers // 6, fp.num_layers // 2)}
    out = {}
    for batch in (1, 16):
        prompts = [ARTICLE.format(t=t) for t in TITLES[:batch]]
        tok = llm.tokenizer
        tok.padding_side = "left"
        enc = {k: v.to(dev) for k, v in tok(prompts, return_tensors="pt", padding=True).items()}
        kw = dict(
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )

        def plain():
            with torch.no_grad():
                llm.model.generate(**enc, **kw)

        def realtime():
            with torch.no_grad(), detector.monitor() as rec:
                llm.model.generate(**enc, logits_processor=[rec], **kw)
            return rec.traces(set())

        def ctrla():
            monitor = ConfidenceMonitor(llm.model, directions)
            with torch.no_grad(), steer(llm.model, steering), monitor:
                llm.model.generate(**enc, **kw)
            return monitor.scores().cpu()

        plain()
        ops = {
            name: operations(fn) / max_new_tokens
            for name, fn in (("plain", plain), ("realtime", realtime), ("ctrla", ctrla))
        }
        times = {"plain": [], "realtime": [], "ctrla": []}
        for _ in range(repeats):  # interleaved so drifts in machine load hit all three alike
            for name, fn in (("plain", plain), ("realtime", realtime), ("ctrla", ctrla)):
                times[name].append(timed(fn, dev, 1)[0])
        best = {k: min(v) for k, v in times.items()}
        paired = {k: np.array(times[k]) / np.array(times["plain"]) for k in ("realtime", "ctrla")}
        out[f"batch_{batch}"] = {
            "plain_s": round(best["plain"], 4),
            "realtime_over_plain": round(best["realtime"] / best["plain"], 3),
            "ctrla_over_plain": round(best["ctrla"] / best["plain"], 3),
            # each round's variant over the same round's plain call: the median and the middle half of the rounds
            "paired_ratio_median_q25_q75": {
                k: [round(float(np.quantile(v, q)), 3) for q in (0.5, 0.25, 0.75)] for k, v in paired.items()
            },
            "operations_per_token": {k: round(v, 1) for k, v in ops.items()},
            "added_operations_percent": {k: round(100 * (ops[k] / ops["plain"] - 1), 1) for k in ("realtime", "ctrla")},
        }
    return out


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def operations(fn: Callable[[], object]) -> int:
    """How many tensor operations ``fn`` dispatches (views included): where a step's few kernels cost less than their
    launches (batch 1 on a GPU), a monitor's overhead is about its share of these."""
    with _Count() as count:
        fn()
    return count.n


def rag_section(llm: LLM, params: str, n_questions: int, max_new_tokens: int, repeats: int) -> dict:
    rag, index = load_section("rag_eval", params), load_section("index_corpus", params)
    spacy_model = load_section("build_realtime", params).spacy_model
    prompt = load_section("build_early", params).features.prompt
    questions = (QUESTIONS * (n_questions // len(QUESTIONS) + 1))[:n_questions]
    passages = [Passage(f"p{i}", t, ARTICLE.format(t=t).split("\n\n")[1] + " trade.") for i, t in enumerate(TITLES)]
    retriever = BM25Retriever.build(passages, index.bm25)
    trigger = make_trigger("rind", llm, None, spacy_model)

    def loop(batch: int) -> RagLoop:
        config = RagConfig(
            "rind", prompt, k=rag.k, max_retrievals=2, max_new_tokens=max_new_tokens, stop=(), batch_size=batch
        )
        return RagLoop(llm, retriever, config, [trigger])

    traces = loop(n_questions).trace(questions)
    scores = np.concatenate([t.token_scores["rind"] for t in traces])
    trigger.threshold = float(np.median(scores[scores > 0]))  # RIND is 0 on stop words and punctuation
    times, out = {}, {}
    for batch in (n_questions, 1):
        times[batch], out[batch] = timed(lambda b=batch: loop(b).answer_all(questions), llm.device, repeats)
    batched, single = out[n_questions], out[1]

    def retrievals(r) -> list:
        return [(x.trigger, x.position, x.queries, x.passage_ids) for x in r.retrievals]

    return {
        "questions": n_questions,
        "new_tokens": max_new_tokens,
        "rind_threshold": round(trigger.threshold, 5),
        "retrievals_per_question": round(float(np.mean([len(r.retrievals) for r in batched])), 2),
        "s_per_question": {
            k: round(v / n_questions, 5) for k, v in (("batched", times[n_questions]), ("one", times[1]))
        },
        "speedup_batched_vs_one": round(times[1] / times[n_questions], 2),
        "same_answers": sum(a.answer == b.answer for a, b in zip(batched, single)),
        "same_retrievals": sum(retrievals(a) == retrievals(b) for a, b in zip(batched, single)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--questions", type=int, default=None, help="questions per IG run (default 32 on a GPU, 12 on a CPU)"
    )
    parser.add_argument("--n-steps", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--repeats", type=int, default=None, help="timings per variant (default 5 on a GPU, 2 on a CPU)"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="what to measure")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: paths.llm)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.repeats = args.repeats or (5 if gpu else 2)
    shapes = args.shape or (sorted(SHAPES) if gpu else ["smollm2-135m"])
    dtype = torch.bfloat16 if gpu else torch.float32
    paths, features = load_section("paths", args.params), load_section("build_early", args.params).features
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or paths.llm)
    name = torch.cuda.get_device_name(args.device) if gpu else platform.processor() or platform.machine()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None) if gpu else None
    result = {
        "device": name,
        "device_kind": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "shapes": {},
    }
    for shape in shapes:
        llm = random_llm(shape, tokenizer, args.device, dtype)
        n_questions = args.questions or (32 if gpu else 12)
        runs = {
            "ig": lambda llm: ig_section(llm, features.prompt, n_questions, args.n_steps, args.repeats, peak),
            "workers": lambda llm: worker_section(llm, features, n_questions, args.max_new_tokens, args.repeats),
            "monitors": lambda llm: monitor_section(llm, args.max_new_tokens, args.repeats),
            "rag_loop": lambda llm: rag_section(llm, args.params, 16, args.max_new_tokens, 1),
        }
        section = {}
        for name in args.sections:
            section[name] = runs[name](llm)
            print(shape, name, json.dumps(section[name]), flush=True)
        result["shapes"][shape] = section
        print(shape, json.dumps(section), flush=True)
        del llm
        if gpu:
            torch.cuda.empty_cache()
    out = args.out or f"benchmarks/results/throughput_{'gpu' if gpu else 'cpu'}.json"
    write_json(out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
