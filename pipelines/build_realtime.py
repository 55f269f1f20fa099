"""Stage build_realtime: the entity-hallucination set (DioR Alg. 2, App. A.2).

Each article is truncated before an entity, continued by the LLM (hidden states of every generated
token captured by the recorder while it generates), and its continuation's entities are labelled
against the original's. Work is written in shards; a rerun computes only the unfinished shards and the
records that failed.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pandas as pd
import torch
from safetensors.numpy import save_file

from detectors.dior.entities import EntityTools
from detectors.dior.realtime_set import build_records, report
from detectors.execution import LLMSpec
from detectors.io import write_json
from detectors.llm.layers import hidden_state_indices
from detectors.shards import ShardStore, run_shards
from pipelines._provenance import open_shards
from pipelines._stage import run, stage_params

log = logging.getLogger("build_realtime")
READS = (
    "llm",
    "build_realtime",
    "execution",
    "paths.llm",
    "paths.articles",
    "paths.realtime_shards",
    "paths.realtime",
    "paths.realtime_hidden",
    "paths.realtime_report",
)
DEPS = (
    "${paths.llm}",
    "${paths.articles}",
)
OUTS = (
    ("${paths.realtime_shards}", {"persist": True, "cache": False}, "resumable work: kept when a killed run restarts"),
    "${paths.realtime}",
    "${paths.realtime_hidden}",
    ("${paths.realtime_report}", {"cache": False}),
)
HIDDEN = ".hidden.safetensors"
LIBRARIES = ("torch", "transformers", "tokenizers", "spacy", "sentence-transformers")  # versions in the shard key


class ShardWorker:
    """Computes and writes shards of the real-time set (records, then the hidden-state sidecar); loads the LLM, spaCy
    and the embedding model once (in the stage's process or a Ray actor)."""

    def __init__(self, llm: LLMSpec, params, store: ShardStore):
        self.llm, self.params, self.store = llm.load(), params, store
        self.state_indices = hidden_state_indices(
            params.hidden_layers, self.llm.fingerprint.num_layers, "build_realtime.hidden_layers"
        )
        self.tools = EntityTools(params.spacy_model, params.embedding_model)

    def __call__(self, shard: tuple[int, pd.DataFrame]) -> pd.DataFrame:
        k, chunk = shard
        with torch.no_grad():
            rows, hidden = build_records(self.llm, self.tools, chunk, self.state_indices, self.params)
        self.store.write_arrays(k, HIDDEN, hidden)
        records = pd.DataFrame(rows)
        self.store.write(k, records)
        return records[["id", "status"]]


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "build_realtime")
    realtime = params["build_realtime"]
    table = pd.read_parquet(params["paths.articles"])
    llm = LLMSpec.of(params)
    # bad layers fail before any work
    hidden_state_indices(realtime.hidden_layers, llm.key()["num_layers"], "build_realtime.hidden_layers")
    inputs = {"articles": params["paths.articles"]}
    store, budget = open_shards(
        "build_realtime", realtime, llm, inputs, LIBRARIES, params["paths.realtime_shards"], len(table)
    )
    worker = functools.partial(ShardWorker, llm, realtime, store)
    run_shards(store, table, realtime.shard_size, worker, params["execution"], budget, "build_realtime", "article")
    write_outputs(
        store,
        len(table),
        realtime.shard_size,
        params["paths.realtime"],
        params["paths.realtime_hidden"],
        params["paths.realtime_report"],
    )


def write_outputs(store: ShardStore, n_items: int, size: int, out: str, hidden_out: str, report_path: str) -> None:
    """One table and one float16 tensor of all generated tokens' hidden states (rows ``hidden_offset`` on)."""
    frame, hidden = store.read_with_arrays(n_items, size, HIDDEN, "hidden_offset")
    for path in (out, hidden_out):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out, index=False)
    save_file({"hidden": hidden}, hidden_out)
    summary = report(frame)
    write_json(report_path, summary)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "failures"})


if __name__ == "__main__":
    run(main)
