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

With ``--configuration NAME`` (repeatable), rows of ``rag_eval.configurations`` instead, as ``params.yaml`` writes
them (triggers, query formulation, DioR's post-retrieval step, steering) with the registered detectors of the project's
MLflow store (``mlflow.tracking_uri``, after ``dvc repro``) at their own thresholds: ``dior-realtime`` (the engine
scores DioR's MLP) and ``ctrla`` (the engine scores CtrlA's confidence under the honesty steering it applies). The
engine loads the detectors from the same store (``$MLFLOW_TRACKING_URI``).

Questions: the first ``--questions`` of the validation split of ``paths.qa`` (a measurement reads no test question).
Corpus: the QA facts as passages (:func:`detectors.rag.corpus.qa_fact_passages`), indexed in memory with
``index_corpus.bm25``. The prompt, context, k, budget and stop strings are ``rag_eval``'s. Run nothing else on the
machine meanwhile.

Run: ``python -m benchmarks.rag_vllm [--questions 100] [--dtype bfloat16] [--out PATH]`` after ``dvc repro prepare``
(vLLM installed: ``make setup``); ``python -m benchmarks.rag_vllm --configuration dior-realtime --configuration ctrla
--out benchmarks/results/rag_vllm_detectors_cpu.json`` after ``dvc repro``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = {"flare": 0.6, "entropy_max": 3.0}  # fixed operating points (FLARE: a token under probability 0.4)


def trace(result) -> list:
    return [[r.trigger, r.position, r.queries, r.passage_ids] for r in result.retrievals]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default="data/llm", help="the prepared LLM (dvc repro prepare)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE on a CPU")
    parser.add_argument("--threshold", nargs=2, action="append", metavar=("TRIGGER", "VALUE"), default=[])
    parser.add_argument("--configuration", action="append", default=[], help="a rag_eval.configurations row")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/rag_vllm_cpu.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)

    import pandas as pd
    import vllm

    from detectors.config import load_section
    from detectors.inference import load_detector
    from detectors.llm.loading import load_llm
    from detectors.rag.corpus import qa_fact_passages
    from detectors.rag.families import make_query, make_trigger
    from detectors.rag.loop import RagConfig, RagLoop
    from detectors.rag.retriever import BM25Retriever
    from detectors.registry import store

    rag, early = load_section("rag_eval", args.params), load_section("build_early", args.params)
    paths = load_section("paths", args.params)
    uri = None  # the store of the registered detectors, read only by --configuration rows
    if args.configuration:
        uri = store.configure(load_section("mlflow", args.params).tracking_uri)
        os.environ["MLFLOW_TRACKING_URI"] = uri  # where the engine's plugin loads the detectors the requests name
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
    spacy = load_section("build_realtime", args.params).spacy_model
    rows = {n: rag.configurations[n] for n in args.configuration}
    loops = {}  # name -> (its loop's arguments on each engine)
    for name in rows or thresholds:
        row = rows.get(name)
        specs = row.triggers if row else [name]
        triggers = [make_trigger(s, llm, thresholds, spacy, uri, rag.settings) for s in specs]
        steering = (row.steering if row else None) or None
        vectors = None if steering is None else load_detector(*steering.split("@"), llm=llm, tracking_uri=uri).vectors()
        query = make_query(row.query, rag.query_settings, triggers, getattr(retriever, "idf", None)) if row else None
        config = RagConfig(
            name, early.features.prompt, context=rag.context, k=rag.k, max_retrievals=rag.max_retrievals,
            max_new_tokens=rag.max_new_tokens, stop=tuple(early.stop), batch_size=rag.batch_size,
            stepwise=bool(row and row.stepwise), chunk=bool(row and row.chunk),
        )  # fmt: skip
        loops[name] = (config, triggers, query, {"hf": {"steering": vectors}, "vllm": {"steering": steering}})
    if rows:
        out["thresholds"] = {t.name: t.threshold for _, triggers, _, _ in loops.values() for t in triggers}
    for name, (config, triggers, query, steering) in loops.items():
        results, seconds = {}, {}
        for side, kwargs in (("hf", {}), ("vllm", {"engine": engine})):
            loop = RagLoop(llm, retriever, config, triggers, query, **kwargs, **steering[side])
            began = time.perf_counter()
            results[side] = loop.answer_all(questions)
            seconds[side] = (time.perf_counter() - began) / len(questions)
        pairs = list(zip(results["hf"], results["vllm"]))
        out["configurations"][name] = {
            "same_answers": sum(a.answer == b.answer for a, b in pairs),
            "same_traces": sum(trace(a) == trace(b) for a, b in pairs),
            "retrieved": {side: sum(bool(r.retrievals) for r in rs) for side, rs in results.items()},
            "seconds_per_question": seconds,
            "vllm_over_hf": seconds["vllm"] / seconds["hf"],
        }
        print(name, json.dumps(out["configurations"][name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
