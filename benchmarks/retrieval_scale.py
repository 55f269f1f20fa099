"""Retrieval at the papers' scale: this checkout's bm25s retriever against an earlier commit's ("today's"), on synthetic
corpora of 100-word passages and on the default corpora, in one run.

What it measures
----------------
* **Corpora**: ``--sizes`` passages (default 1M and 5M) of 100 words drawn independently from the `wiki` corpus's
  words at their frequencies in it (its Zipf law), written as JSONL under ``--workdir``; and the default corpora
  (`wiki`, `facts` from ``--qa``).
* **Build** (``index_corpus``'s reading and indexing of the JSONL, in a child process): seconds, peak resident memory
  (``ru_maxrss``) and peak anonymous memory (the process's own, sampled from ``/proc``: what the page cache does not
  hold). The reference builds only up to ``--reference-build-max`` passages: it holds the whole corpus.
* **Load** (a child process that opens the index and searches it): seconds to open it (hashes checked), resident and
  anonymous memory after opening, with the files in the page cache (the build or the run before read them).
* **Search**, at k = 3: p50/p95 latency of one query (``search``) for the QA test questions (``--qa``'s test split)
  and for DRAGIN-length queries (the first 60 words of wiki passages: about 30 index terms); the same queries in batches
  of 32 (``batch_search``) on 1 and 2 threads (ours) or serially (the reference's loop): queries a second. The
  reference searches the index this checkout built (the files are the same bytes: checked by the digests).
* **Hits**: every query's hits (passage ids, scores, ranks) of both sides, compared; on the default corpora, the
  index digests of both builds too.

The reference is ``--reference`` (default ``e223b63``, the retriever before issue 49) extracted with ``git archive``
into a temporary directory and run in child processes, as this checkout is. Timings are reported, never asserted;
run nothing heavy beside it.

The batches also report their CPU time a query and the CPUs they kept busy: on a shared machine, what a query costs
whatever else runs, and how much parallelism the threads got.

Run: ``python -m benchmarks.retrieval_scale [--sizes 1000000 5000000] [--qa data/prepared/qa.parquet] [--workdir DIR]
[--out benchmarks/results/retrieval_scale_cpu.json]``; ``--search-only INDEX`` measures only this checkout's loading and
search of an index built before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BM25 = {"method": "lucene", "k1": 1.5, "b": 0.75, "stopwords": "en", "stemmer": "english"}
K = 3
BATCH = 32
WORDS = 100
LONG = 60  # words of a DRAGIN-length query: about 30 index terms (DRAGIN: the 25-35 words it attends to most)


# ---- inputs ---------------------------------------------------------------------------------------------------
def wiki_words() -> tuple[np.ndarray, np.ndarray]:
    """The words of the `wiki` corpus (split at white space) and their frequencies in it."""
    from collections import Counter

    from detectors.rag.corpus import ovos_passages

    counts = Counter(w for p in ovos_passages() for w in p.text.split())
    words, freq = zip(*counts.most_common())
    return np.array(words, dtype=object), np.array(freq, dtype=np.float64) / sum(freq)


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
    """``n`` passages of :data:`WORDS` words drawn from the wiki words at their frequencies, as JSONL."""
    words, p = wiki_words()
    rng = np.random.default_rng(seed)
    cumulative = np.cumsum(p)
    with open(path, "w", encoding="utf-8") as f:
        for start in range(0, n, 100_000):
            rows = min(100_000, n - start)
            drawn = np.searchsorted(cumulative, rng.random((rows, WORDS)) * cumulative[-1])
            drawn = np.minimum(drawn, len(words) - 1)
            text = words[drawn]
            f.writelines(
                json.dumps({"id": str(start + i), "text": " ".join(text[i])}, ensure_ascii=False) + "\n"
                for i in range(rows)
            )


def queries(qa: Path | None, n_long: int = 200, seed: int = 1) -> dict[str, list[str]]:
    """The QA test questions (the fixture's questions without a QA table) and DRAGIN-length queries."""
    import pandas as pd

    from detectors.rag.corpus import ovos_passages

    if qa is not None and qa.is_file():
        table = pd.read_parquet(qa)
        questions = list(table.loc[table["split"] == "test", "question"])
    else:
        fixture = ROOT / "data" / "fixtures" / "qa_small.jsonl"
        questions = [json.loads(line)["question"] for line in fixture.read_text().splitlines() if line.strip()]
    passages = [p for p in ovos_passages() if len(p.text.split()) >= 60]
    picked = np.random.default_rng(seed).choice(len(passages), size=n_long, replace=False)
    return {"questions": questions, "long": [" ".join(passages[i].text.split()[:LONG]) for i in picked]}


# ---- the child processes ----------------------------------------------------------------------------------------
def child_build(side: str, corpus: str, out: str) -> dict:
    """Index a JSONL corpus (or `wiki`/`facts:<qa>`) as ``index_corpus`` does, on either side's code."""
    from detectors.rag import corpus as c
    from detectors.rag.retriever import BM25Retriever

    start = time.perf_counter()
    if corpus == "wiki":
        passages = c.ovos_passages()
    elif corpus.startswith("facts:"):
        import pandas as pd

        passages = c.qa_fact_passages(pd.read_parquet(corpus[6:]))
    elif side == "ours":
        passages = c.JsonlPassages(corpus, "id", None, "text")
    else:
        passages = c.jsonl_passages(corpus, "id", None, "text")
    if side == "ours":
        manifest = BM25Retriever.build(passages, BM25, out).manifest
    else:
        manifest = BM25Retriever.build(passages, BM25).save(out)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "digest": manifest["digest"], "passages": manifest["passages"]}


def _memory() -> dict[str, float]:
    """This process's resident memory now, GiB: all, anonymous (its own), file-backed (mapped files)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {k: int(status[k].split()[0]) for k in ("VmRSS", "RssAnon", "RssFile")}
    return {k: round(v / 2**20, 3) for k, v in kib.items()}


def _percentiles(seconds: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(1000 * float(np.percentile(seconds, 50)), 2),
        "p95_ms": round(1000 * float(np.percentile(seconds, 95)), 2),
    }


def child_search(side: str, index: str, query_file: str, hits_out: str) -> dict:
    """Open the index (timed), then search: one query at a time, batches of 32 on 1 and 2 threads (ours)."""
    from detectors.rag.retriever import BM25Retriever

    sets = json.loads(Path(query_file).read_text())
    start = time.perf_counter()
    if side == "ours":
        from detectors.rag.retriever import open_index

        retriever = open_index(index)
    else:
        retriever = BM25Retriever.load(index)
    report = {"load_seconds": round(time.perf_counter() - start, 3), "memory_after_load": _memory()}
    report["code"] = str(Path(sys.modules[BM25Retriever.__module__].__file__).parents[2])
    report["terms_per_query"] = {
        n: round(float(np.mean([len(retriever.terms(q)) for q in qs])), 1) for n, qs in sets.items()
    }
    retriever.search(sets["long"][0], K)  # the kernel compiled or read from numba's cache, the pages touched
    hits = {}
    for name, qs in sets.items():
        seconds, found = [], []
        for q in qs:
            t = time.perf_counter()
            found.append(retriever.search(q, K))
            seconds.append(time.perf_counter() - t)
        report[name] = _percentiles(seconds)
        hits[name] = [[[h.passage.id, h.score, h.rank] for h in one] for one in found]
        batches = [qs[i : i + BATCH] for i in range(0, len(qs) - BATCH + 1, BATCH)]
        if side != "ours":  # its batch_search is a loop over search: the same queries one by one
            per_batch = [sum(seconds[i : i + BATCH]) for i in range(0, len(batches) * BATCH, BATCH)]
            report[name][f"batch{BATCH}_queries_per_s_1_threads"] = round(len(per_batch) * BATCH / sum(per_batch), 1)
            continue
        for threads in (1, 2):
            retriever.threads = threads
            t, cpu = time.perf_counter(), time.process_time()
            batched = [found for batch in batches for found in retriever.batch_search(batch, K)]
            elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
            report[name][f"batch{BATCH}_queries_per_s_{threads}_threads"] = round(len(batches) * BATCH / elapsed, 1)
            # CPU time: what a query costs whatever else runs on the machine; busy CPUs: the parallelism it got
            report[name][f"batch{BATCH}_cpu_ms_per_query_{threads}_threads"] = round(1000 * cpu / len(batched), 2)
            report[name][f"batch{BATCH}_busy_cpus_{threads}_threads"] = round(cpu / elapsed, 2)
            report[name][f"batch_hits_as_one_by_one_{threads}_threads"] = batched == found[: len(batched)]
    report["memory_after_search"] = _memory()
    Path(hits_out).write_text(json.dumps(hits))
    return report


# ---- the parent ---------------------------------------------------------------------------------------------------
def run_child(side: str, code: Path, *args: str) -> dict:
    """``python -m benchmarks.retrieval_scale --child ...`` on ``code``'s detectors; its JSON answer, with its peak
    resident memory (``ru_maxrss``) and peak anonymous memory (sampled from ``/proc`` every 0.1 s)."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "benchmarks.retrieval_scale", "--child", side, *args]
    proc = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.PIPE, text=True)
    peak, done = {"RssAnon": 0}, threading.Event()

    def sample() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                line = next(x for x in status.read_text().splitlines() if x.startswith("RssAnon:"))
                peak["RssAnon"] = max(peak["RssAnon"], int(line.split()[1]))
            except (OSError, StopIteration):
                pass
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own ru_maxrss (Popen has not reaped it)
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{side} {args[0]} failed ({proc.returncode}); see its stderr above")
    answer = json.loads(out.strip().splitlines()[-1])
    answer["peak_rss_gib"] = round(usage.ru_maxrss / 2**20, 3)
    answer["peak_anon_gib"] = round(peak["RssAnon"] / 2**20, 3)
    return answer


def read_manifest_passages(directory: Path) -> int:
    return json.loads((directory / "manifest.json").read_text())["passages"]


def compare(ours: dict, reference: dict) -> dict:
    """How many queries of each set have identical hits on both sides."""
    return {name: f"{sum(a == b for a, b in zip(ours[name], reference[name]))}/{len(ours[name])}" for name in ours}


def measure(
    name: str, corpus: str, reference_builds: bool, code: dict[str, Path], work: Path, query_file: Path
) -> dict:
    result: dict = {"corpus": name}
    for side in ("ours", "reference") if reference_builds else ("ours",):
        out = work / f"{name}-{side}"
        shutil.rmtree(out, ignore_errors=True)
        result[f"build_{side}"] = run_child(side, code[side], "build", corpus, str(out))
        print(name, side, "build", result[f"build_{side}"], flush=True)
    if reference_builds:
        result["same_digest"] = result["build_ours"]["digest"] == result["build_reference"]["digest"]
        shutil.rmtree(work / f"{name}-reference")
    hits = {}
    for side in ("ours", "reference"):
        hits_file = work / f"hits-{side}.json"
        result[f"search_{side}"] = run_child(
            side, code[side], "search", str(work / f"{name}-ours"), str(query_file), str(hits_file)
        )
        hits[side] = json.loads(hits_file.read_text())
        print(name, side, "search", result[f"search_{side}"], flush=True)
    result["identical_hits"] = compare(hits["ours"], hits["reference"])
    result["ratios"] = ratios(result)
    return result


def ratios(result: dict) -> dict:
    """Reference / ours (> 1: ours is faster or smaller)."""
    ours, ref = result["search_ours"], result["search_reference"]
    out = {
        "load_seconds": round(ref["load_seconds"] / ours["load_seconds"], 2),
        "load_anon_memory": round(
            ref["memory_after_load"]["RssAnon"] / max(ours["memory_after_load"]["RssAnon"], 1e-3), 2
        ),
    }
    for name in ("questions", "long"):
        out[f"{name}_p50"] = round(ref[name]["p50_ms"] / ours[name]["p50_ms"], 1)
        out[f"{name}_batch_2_threads_vs_reference"] = round(
            ours[name][f"batch{BATCH}_queries_per_s_2_threads"] / ref[name][f"batch{BATCH}_queries_per_s_1_threads"], 1
        )
    if "build_reference" in result:
        b_ours, b_ref = result["build_ours"], result["build_reference"]
        out["build_seconds"] = round(b_ref["seconds"] / b_ours["seconds"], 2)
        out["build_peak_anon"] = round(b_ref["peak_anon_gib"] / b_ours["peak_anon_gib"], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1_000_000, 5_000_000])
    parser.add_argument("--reference", default="e223b63", help="git commit of the reference code")
    parser.add_argument("--reference-build-max", type=int, default=1_000_000, help="largest corpus it builds")
    parser.add_argument("--qa", type=Path, default=ROOT / "data" / "prepared" / "qa.parquet")
    parser.add_argument("--workdir", type=Path, default=None, help="where the corpora and indexes go (default: /tmp)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "retrieval_scale_cpu.json")
    parser.add_argument("--search-only", type=Path, help="only search this index (built before) with this checkout")
    args = parser.parse_args(argv)
    if args.child:
        side, what, *rest = args.child
        answer = child_build(side, *rest) if what == "build" else child_search(side, *rest)
        print(json.dumps(answer))
        return
    work = Path(tempfile.mkdtemp(prefix="retrieval_scale-", dir=args.workdir))
    if args.search_only:
        try:
            (work / "queries.json").write_text(json.dumps(queries(args.qa)))
            start = os.getloadavg()
            found = run_child(
                "ours", ROOT, "search", str(args.search_only), str(work / "queries.json"), str(work / "h")
            )
            found["passages"] = read_manifest_passages(args.search_only)
            out = {"date": time.strftime("%Y-%m-%d"), "load_average_at_start": start, "search_ours": found}
            args.out.write_text(json.dumps({**out, "load_average_at_end": os.getloadavg()}, indent=2) + "\n")
            print(f"wrote {args.out}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        reference = work / "reference"
        reference.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.reference, "detectors"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(reference)], input=archive, check=True)
        code = {"ours": ROOT, "reference": reference}
        query_file = work / "queries.json"
        query_file.write_text(json.dumps(queries(args.qa)))
        results = {
            "date": time.strftime("%Y-%m-%d"),
            "load_average_at_start": os.getloadavg(),
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cpus": len(os.sched_getaffinity(0)),
                "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            },
            "reference": args.reference,
            "k": K,
            "queries": {name: len(qs) for name, qs in json.loads(query_file.read_text()).items()},
            "corpora": [],
        }
        defaults = [("wiki", "wiki")] + ([("facts", f"facts:{args.qa}")] if args.qa.is_file() else [])
        for name, corpus in defaults:
            results["corpora"].append(measure(name, corpus, True, code, work, query_file))
        for n in args.sizes:
            path = work / f"synthetic-{n}.jsonl"
            start = time.perf_counter()
            write_corpus(path, n)
            print(f"{n} passages written in {time.perf_counter() - start:.0f} s", flush=True)
            entry = measure(f"synthetic-{n}", str(path), n <= args.reference_build_max, code, work, query_file)
            entry["passages"], entry["bytes"] = n, path.stat().st_size
            entry["index_bytes"] = sum(f.stat().st_size for f in (work / f"synthetic-{n}-ours").rglob("*"))
            results["corpora"].append(entry)
            path.unlink()
            shutil.rmtree(work / f"synthetic-{n}-ours")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")  # what is measured so far
        results["load_average_at_end"] = os.getloadavg()
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
