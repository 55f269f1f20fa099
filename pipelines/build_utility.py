"""Stage build_utility: retrieval-utility labels (does retrieving for a question help its answer, hurt it, or neither?).

Every usable question of the early set (all splits) is answered with the top-k passages retrieved with the question
from each corpus of ``build_utility.corpora``, by the RAG loop of rag_eval (its prompt, context, k and decoding: the
answer is single-round RAG's), beside its answer without passages (the early set's); see
:mod:`detectors.utility.labels`. Work is written in resumable shards, one store per corpus
(``paths.utility_shards/<corpus>/``, keyed on that corpus's index and not on the list of corpora, so leaving a corpus
out or adding one keeps the others' finished shards); writes ``paths.utility`` (one row per corpus x question: label,
both answers, post-retrieval columns) and the label balance per corpus and split (``paths.utility_report``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pandas as pd

from detectors.execution import LLMSpec
from detectors.io import write_json
from detectors.llm.layers import hidden_state_indices
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.recording import recording_loop
from detectors.rag.retriever import open_index
from detectors.shards import OK, ShardStore, run_shards, status_counts
from detectors.utility.labels import RecordingGate, balance, utility_records
from pipelines._provenance import open_shards
from pipelines._stage import run, stage_params

log = logging.getLogger("build_utility")
LIBRARIES = ("torch", "transformers", "tokenizers", "bm25s")
READS = (
    "llm",
    "build_utility",
    "execution",
    "build_early.features.prompt",
    "build_early.features.hidden_layers",
    "build_early.stop",
    "rag_eval.k",
    "rag_eval.context",
    "rag_eval.max_new_tokens",
    "paths.llm",
    "paths.early",
    "paths.rag_index",
    "paths.utility_shards",
    "paths.utility",
    "paths.utility_report",
)
DEPS = (
    "${paths.llm}",
    "${paths.early}",
    "${paths.rag_index}",
)
OUTS = (
    ("${paths.utility_shards}", {"persist": True, "cache": False}, "resumable work: kept when a killed run restarts"),
    "${paths.utility}",
    ("${paths.utility_report}", {"cache": False}),
)


def rag_config(params, batch_size: int) -> RagConfig:
    """Single-round RAG as rag_eval runs it: one retrieval with the question, before the answer."""
    return RagConfig(
        "utility-labels",
        prompt=params["build_early.features.prompt"],
        context=params["rag_eval.context"],
        k=params["rag_eval.k"],
        max_retrievals=1,
        max_new_tokens=params["rag_eval.max_new_tokens"],
        stop=tuple(params["build_early.stop"]),
        batch_size=batch_size,
    )


class ShardWorker:
    """Labels shards of (corpus, question) rows, one corpus per shard, into that corpus's store; loads the LLM once and
    each corpus's retriever when first needed."""

    def __init__(self, llm: LLMSpec, params, stores: dict[str, ShardStore]):
        self.llm, self.p, self.stores = llm.load(), params, stores
        key = "build_early.features.hidden_layers"
        self.layers = hidden_state_indices(params[key], self.llm.fingerprint.num_layers, key)
        self.config, self.loops = rag_config(params, params["build_utility"].batch_size), {}

    def loop(self, corpus: str) -> tuple[RagLoop, RecordingGate]:
        """The corpus's recording loop and its gate (:func:`~detectors.rag.recording.recording_loop`)."""
        if corpus not in self.loops:
            retriever = open_index(Path(self.p["paths.rag_index"]) / corpus)
            self.loops[corpus] = recording_loop(self.llm, retriever, self.config, self.layers)
        return self.loops[corpus]

    def __call__(self, shard: tuple[int, pd.DataFrame]) -> pd.DataFrame:
        k, rows = shard
        (corpus,) = rows["corpus"].unique()
        records = utility_records(
            *self.loop(corpus), list(rows["question"]), [list(a) for a in rows["answers"]], list(rows["answer"])
        )
        out = []
        for base, rec in zip(rows.to_dict("records"), records):
            error = rec.pop("error")
            out.append({**base, **rec, "status": OK if error is None else f"skipped: {error}"})
        frame = pd.DataFrame(out)
        self.stores[corpus].write(k, frame)
        return frame[["id", "status"]]


class BuiltOnce:
    """``make_worker`` for several :func:`~detectors.shards.run_shards` calls: the local backend builds the worker
    (it loads the LLM) at the first call and hands the same one to the next; a Ray actor builds its own."""

    def __init__(self, make_worker):
        self.make_worker, self.worker = make_worker, None

    def __call__(self):
        if self.worker is None:
            self.worker = self.make_worker()
        return self.worker

    def __getstate__(self):
        return {"make_worker": self.make_worker, "worker": None}  # an actor never receives the driver's LLM


def questions(early: pd.DataFrame, corpora: list[str]) -> pd.DataFrame:
    """One row per corpus x usable early-set question: what the labels need of it."""
    ok = early[early["status"] == OK][["id", "split", "question", "answers", "answer"]]
    table = pd.concat([ok.assign(corpus=c) for c in corpora] or [ok.iloc[:0].assign(corpus="")], ignore_index=True)
    return table.assign(key=table["corpus"] + "/" + table["id"].astype(str))


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "build_utility")
    utility = params["build_utility"]
    missing = [c for c in utility.corpora if not (Path(params["paths.rag_index"]) / c).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"build_utility.corpora {missing} have no index under {params['paths.rag_index']}: "
            "add them to index_corpus.corpora and run `dvc repro index_corpus`"
        )
    table = questions(pd.read_parquet(params["paths.early"]), utility.corpora)
    out = Path(params["paths.utility"])
    out.parent.mkdir(parents=True, exist_ok=True)
    if table.empty:  # no corpus: no utility trigger is trained
        table.assign(status=[]).to_parquet(out, index=False)
        write_json(params["paths.utility_report"], {"records": 0, "balance": {}})
        return
    llm = LLMSpec.of(params)
    shared = {k: params[k] for k in READS if k.startswith(("build_early.", "rag_eval."))}
    parts = {}  # corpus -> (its rows, its store, its failure budget)
    for corpus in utility.corpora:
        # a shard row's id is corpus/question id
        rows = table[table["corpus"] == corpus].rename(columns={"id": "question_id", "key": "id"})
        inputs = {
            "early": params["paths.early"],
            "index": str(Path(params["paths.rag_index"]) / corpus / "manifest.json"),
        }
        # each corpus its own store, keyed without the list of corpora: leaving a corpus out or adding one keeps the
        # others' finished shards
        store, budget = open_shards(
            "build_utility",
            utility,
            llm,
            inputs,
            LIBRARIES,
            str(Path(params["paths.utility_shards"]) / corpus),
            len(rows),
            shared,
            unshaping=("corpora",),
        )
        parts[corpus] = (rows, store, budget)
    make_worker = BuiltOnce(functools.partial(ShardWorker, llm, params, {c: s for c, (_, s, _) in parts.items()}))
    for corpus, (rows, store, budget) in parts.items():
        run_shards(
            store,
            rows,
            utility.shard_size,
            make_worker,
            params["execution"],
            budget,
            f"build_utility {corpus}",
            "q",
        )
    frame = pd.concat(
        [store.read_all(len(rows), utility.shard_size) for rows, store, _ in parts.values()], ignore_index=True
    ).rename(columns={"id": "key", "question_id": "id"})
    frame.to_parquet(out, index=False)
    ok = frame[frame["status"] == OK]
    summary = {**status_counts(frame), "balance": {c: balance(g) for c, g in ok.groupby("corpus")}}
    write_json(params["paths.utility_report"], summary)
    log.info("done: %s", summary["balance"])


if __name__ == "__main__":
    run(main)
