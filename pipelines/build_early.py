"""Stage build_early: the early-detection set (DioR Alg. 1): answer, label and IG features per question, and the
hidden states of every answer token (the real-time detector's candidate training set of QA answers).

Work is written in shards; a rerun computes only the unfinished shards and the records that failed.
A shard's questions are computed as one batch (shared prompt prefix, IG steps of many questions per
pass, answers decoded together); when the batch raises, its questions are retried one by one, so an
error costs only the record that causes it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pandas as pd
import torch
from safetensors.numpy import save_file

from detectors.dior.early import early_records
from detectors.execution import LLMSpec, batch_or_each
from detectors.io import write_json
from detectors.llm.layers import hidden_state_indices
from detectors.shards import OK, ShardStore, failure_status, run_shards, status_counts
from pipelines._provenance import open_shards
from pipelines._stage import run, stage_params

log = logging.getLogger("build_early")
LIBRARIES = ("torch", "transformers", "tokenizers", "captum")  # their versions are part of the shard key
READS = (
    "llm",
    "build_early",
    "execution",
    "paths.llm",
    "paths.qa",
    "paths.early_shards",
    "paths.early",
    "paths.early_report",
    "paths.early_answer_hidden",
)
DEPS = (
    "${paths.llm}",
    "${paths.qa}",
)
OUTS = (
    ("${paths.early_shards}", {"persist": True, "cache": False}, "resumable work: kept when a killed run restarts"),
    "${paths.early}",
    "${paths.early_answer_hidden}",
    ("${paths.early_report}", {"cache": False}),
)
HIDDEN = ".answer-hidden.safetensors"


def _records(llm, rows: list, params, state_indices: list[int]) -> list[dict]:
    """The shard's records, the questions computed together; a batch that raises is retried one question at a time."""
    bases = [
        {
            "id": r.id,
            "split": r.split,
            "question": r.question,
            "answers": list(r.answers),
            "feature_dtype": llm.dtype_name,
        }
        for r in rows
    ]

    def compute(group: list[dict]) -> list:
        return early_records(
            llm,
            [b["question"] for b in group],
            [b["answers"] for b in group],
            params.features,
            params.max_new_tokens,
            params.stop,
            state_indices,
        )

    # out of memory: the batch size's problem (build_early.features.ig_batch_size), not a record's
    results = batch_or_each(compute, bases, "build_early: a batch", (torch.OutOfMemoryError,))
    return [
        {**base, "status": failure_status(res)} if isinstance(res, Exception) else {**base, "status": OK, **res}
        for base, res in zip(bases, results)
    ]


def report(frame: pd.DataFrame) -> dict:
    ok = frame[frame["status"] == OK]
    by_split = {
        split: {"n": int(len(g)), "hallucinated": int(g["label"].sum()), "rate": round(float(g["label"].mean()), 4)}
        for split, g in ok.groupby("split")
    }
    return {
        **status_counts(frame),
        "label_balance": by_split,
        "hallucination_rate": round(float(ok["label"].mean()), 4) if len(ok) else None,
    }


class ShardWorker:
    """Computes and writes shards of the early set; loads the LLM once (in the stage's process or a Ray actor)."""

    def __init__(self, llm: LLMSpec, params, store: ShardStore):
        self.llm, self.params, self.store = llm.load(), params, store
        self.state_indices = hidden_state_indices(
            params.answer_hidden_layers, self.llm.fingerprint.num_layers, "build_early.answer_hidden_layers"
        )

    def __call__(self, shard: tuple[int, pd.DataFrame]) -> pd.DataFrame:
        k, rows = shard
        records = _records(self.llm, list(rows.itertuples(index=False)), self.params, self.state_indices)
        hidden = {r["id"]: r.pop("answer_hidden") for r in records if "answer_hidden" in r}
        self.store.write_arrays(k, HIDDEN, hidden)
        records = pd.DataFrame(records)
        self.store.write(k, records)
        return records[["id", "status"]]


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "build_early")
    early = params["build_early"]
    table = pd.read_parquet(params["paths.qa"])
    llm = LLMSpec.of(params)
    # fail before any work
    hidden_state_indices(early.answer_hidden_layers, llm.key()["num_layers"], "build_early.answer_hidden_layers")
    store, budget = open_shards(
        "build_early", early, llm, {"qa": params["paths.qa"]}, LIBRARIES, params["paths.early_shards"], len(table)
    )
    run_shards(
        store,
        table,
        early.shard_size,
        functools.partial(ShardWorker, llm, early, store),
        params["execution"],
        budget,
        "build_early",
        "q",
    )
    frame, hidden = store.read_with_arrays(len(table), early.shard_size, HIDDEN, "answer_hidden_offset")
    for path in (params["paths.early"], params["paths.early_answer_hidden"]):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(params["paths.early"], index=False)
    save_file({"hidden": hidden}, params["paths.early_answer_hidden"])
    summary = report(frame)
    write_json(params["paths.early_report"], summary)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "failures"})


if __name__ == "__main__":
    run(main)
