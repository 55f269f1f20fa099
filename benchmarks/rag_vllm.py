"""The RAG loop's segments generated in vLLM against the project's own decoder, on SmolLM2, in one run.

What it measures
----------------
The configurations whose triggers read what the engine serves (FLARE and the maximum entropy: each token's probability
and its distribution's entropy) answer the same questions, from the same corpus and at the same fixed thresholds, twice:
with the project's batched decoder (the Hugging Face model) and with ``RagLoop(..., engine=)`` (each segment one greedy
vLLM request that ends at its sentence end, the plugin's ``stats`` and ``sentence``), both in ``--dtype``. Reported per
configuration: how many answers and how many retrieval traces (trigger, position, queries, passages) are identical,
how many questions retrieved on each engine, and seconds per question on each and their ratio (only the answering is
timed: loading the LLM and building the engine are not). Differences are the engines' arithmetic: in bfloat16 two
kernels round differently, and a greedy choice between two close tokens can flip (``tests/test_vllm.py`` checks that
the answers are identical in float32 on the tiny Llama).

Questions: the first ``--questions`` of the validation split of ``paths.qa`` (a measurement reads no test question).
Corpus: the QA facts as passages (:func:`detectors.rag.corpus.qa_fact_passages`), indexed in memory with
``index_corpus.bm25``. The prompt, context, k, budget and stop strings are ``rag_eval``'s. Run nothing else on the
machine meanwhile.

Run: ``python -m benchmarks.rag_vllm [--questions 100] [--dtype bfloat16] [--out PATH]`` after ``dvc repro prepare``
(vLLM installed: ``make setup``).

``--runs HF VLLM`` compares two ``rag_eval`` evaluations instead, the same params but ``rag_eval.engine`` (``hf``,
``vllm``), each with its own ``paths.rag_runs``: for every run of one corpus that the second generated in the engine
(its key's ``engine``), the same counts from the stored lines (``HF`` and ``VLLM``: the two ``<rag_runs>/<corpus>``
directories) and the seconds a question each engine's lines were charged (their ``wall_s``: a question's share of its
batches, the measurements it reused included). It reads what the stage wrote and runs nothing:
``python -m benchmarks.rag_vllm --runs data/rag/runs-hf/facts data/rag/runs-vllm/facts --out PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = {"flare": 0.6, "entropy_max": 3.0}  # fixed operating points (FLARE: a token under probability 0.4)


def trace(result: dict) -> list:
    return [[r["trigger"], r["position"], r["queries"], r["passage_ids"]] for r in result["retrievals"]]


def compared(results: dict[str, list[dict]], seconds: dict[str, float]) -> dict:
    """How alike the two engines' results of the same questions are (``results``: by engine, as RAG results' dicts),
    and their seconds a question."""
    pairs = list(zip(results["hf"], results["vllm"]))
    return {
        "questions": len(pairs),
        "same_answers": sum(a["answer"] == b["answer"] for a, b in pairs),
        "same_traces": sum(trace(a) == trace(b) for a, b in pairs),
        "retrieved": {side: sum(bool(r["retrievals"]) for r in rs) for side, rs in results.items()},
        "seconds_per_question": seconds,
        "vllm_over_hf": seconds["vllm"] / seconds["hf"],
    }


def stored(run: Path) -> tuple[dict, list[dict]]:
    """A ``rag_eval`` run's key and its lines in question order, read from its shard store (never written)."""
    import pandas as pd

    key = json.loads((run / "manifest.json").read_text())["config"]
    lines = []
    for shard in sorted(run.glob("shard-*.parquet")):
        frame = pd.read_parquet(shard)
        lines += [{"id": i, **json.loads(line)} for i, line in zip(frame["id"], frame["line"])]
    return key, lines


def compare_runs(hf: Path, on_vllm: Path) -> dict:
    """Every run of ``on_vllm`` generated in the engine against the run of that name in ``hf``."""
    out = {"machine": platform.processor() or platform.machine(), "hf": str(hf), "vllm": str(on_vllm)}
    out["configurations"] = {}
    for run in sorted(p for p in on_vllm.iterdir() if (p / "manifest.json").exists()):
        key, lines = stored(run)
        if key.get("engine") != "vllm":
            continue  # on the Hugging Face engine in both (RIND, the gate, the sweeps)
        hf_key, hf_lines = stored(hf / run.name)
        if [x["id"] for x in hf_lines] != [x["id"] for x in lines]:
            raise SystemExit(
                f"{run.name}: the two runs answered other questions (or one is unfinished): rerun rag_eval"
            )
        results = {"hf": hf_lines, "vllm": lines}
        seconds = {side: sum(x["wall_s"] for x in xs) / len(xs) for side, xs in results.items()}
        out["configurations"][run.name] = {"thresholds": key["thresholds"], **compared(results, seconds)}
        out["llm"] = key["llm"]  # the digest of the LLM both answered with
        print(run.name, json.dumps(out["configurations"][run.name]), flush=True)
    return out


def loops(args) -> dict:
    """FLARE and the maximum entropy, each in a loop on each engine (see the module's docstring)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    import pandas as pd
    import vllm

    from detectors.config import load_section
    from detectors.llm.loading import load_llm
    from detectors.rag.corpus import qa_fact_passages
    from detectors.rag.families import make_trigger
    from detectors.rag.loop import RagConfig, RagLoop
    from detectors.rag.retriever import BM25Retriever

    rag, early = load_section("rag_eval", args.params), load_section("build_early", args.params)
    paths = load_section("paths", args.params)
    qa = pd.read_parquet(paths.qa)
    questions = qa[qa["split"] == "val"]["question"].astype(str).tolist()[: args.questions]
    retriever = BM25Retriever.build(qa_fact_passages(qa), load_section("index_corpus", args.params).bm25)
    llm = load_llm(args.llm, dtype=args.dtype, device="cpu")
    engine = vllm.LLM(model=args.llm, dtype=args.dtype, enforce_eager=True, seed=0, max_model_len=2048)
    thresholds = THRESHOLDS | {name: float(value) for name, value in args.threshold}
    out = {
        "machine": platform.processor() or platform.machine(),
        "llm": llm.fingerprint.name,
        "dtype": args.dtype,
        "questions": len(questions),
        "thresholds": thresholds,
        "configurations": {},
    }
    for name, threshold in thresholds.items():
        config = RagConfig(
            name, early.features.prompt, context=rag.context, k=rag.k, max_retrievals=rag.max_retrievals,
            max_new_tokens=rag.max_new_tokens, stop=tuple(early.stop), batch_size=rag.batch_size,
        )  # fmt: skip
        trigger = make_trigger(name, llm, {name: threshold})
        results, seconds = {}, {}
        for side, kwargs in (("hf", {}), ("vllm", {"engine": engine})):
            loop = RagLoop(llm, retriever, config, [trigger], **kwargs)
            began = time.perf_counter()
            results[side] = [dataclasses.asdict(r) for r in loop.answer_all(questions)]
            seconds[side] = (time.perf_counter() - began) / len(questions)
        out["configurations"][name] = compared(results, seconds)
        print(name, json.dumps(out["configurations"][name]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default="data/llm", help="the prepared LLM (dvc repro prepare)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE on a CPU")
    parser.add_argument("--threshold", nargs=2, action="append", metavar=("TRIGGER", "VALUE"), default=[])
    parser.add_argument("--runs", nargs=2, type=Path, metavar=("HF", "VLLM"), help="two rag_eval runs' corpus dirs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/rag_vllm_cpu.json"))
    args = parser.parse_args(argv)
    if args.runs:
        out = compare_runs(*args.runs)
    else:
        out = loops(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
