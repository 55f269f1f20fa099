"""Stage build_realtime: the entity-hallucination set (DioR Alg. 2, App. A.2).

Each article is truncated before an entity, continued by the LLM (hidden states of every generated
token captured by the recorder while it generates), and its continuation's entities are labelled
against the original's. Work is written in shards; a rerun computes only the unfinished shards and the
records that failed.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.numpy import save_file

from detectors.dior.entities import PARTS, EntityTools, label_continuation, prepare_article
from detectors.dior.recorder import generate_traced
from detectors.execution import LLMSpec
from detectors.io import write_json
from detectors.llm.layers import hidden_state_indices
from detectors.shards import OK, ShardStore, failure_status, run_shards, status_counts
from pipelines._provenance import open_shards
from pipelines._stage import run, stage_params

log = logging.getLogger("build_realtime")
READS = (
    "llm", "build_realtime", "execution", "paths.llm", "paths.articles", "paths.realtime_shards", "paths.realtime",
    "paths.realtime_hidden", "paths.realtime_report",
)  # fmt: skip
HIDDEN = ".hidden.safetensors"
LIBRARIES = ("torch", "transformers", "tokenizers", "spacy", "sentence-transformers")  # versions in the shard key


def _failure(base: dict, err: Exception) -> dict:
    return {**base, "status": failure_status(err)}


def build_shard(llm, tools, chunk: pd.DataFrame, state_indices: list[int], params) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Records of one shard and the hidden states of their generated tokens (by record id). A record that
    raises becomes a skipped or error row (see :mod:`detectors.shards`); a batch whose generation raises
    makes an error row of each of its records. Prompts are batched by token length (left padding wastes less)."""
    rows, ready = [], []
    for art in chunk.itertuples(index=False):
        base = {"id": art.id, "split": art.split, "title": art.title, "feature_dtype": llm.dtype_name}
        try:
            text, prompt, cut, warnings = prepare_article(
                tools, llm, art.id, art.title, art.text, params.prompt, max_new_tokens=params.max_new_tokens,
                max_article_chars=params.max_article_chars, prefix_sentences=params.prefix_sentences,
                min_prefix_chars=params.min_prefix_chars,
            )  # fmt: skip
            ready.append((base, text, prompt, cut, warnings))
        except Exception as err:
            rows.append(_failure(base, err))
    hidden: dict[str, np.ndarray] = {}
    lengths = [len(llm.tokenizer(r[2], add_special_tokens=not params.prompt.chat)["input_ids"]) for r in ready]
    done: dict[str, dict] = {}
    by_length = sorted(range(len(ready)), key=lengths.__getitem__)  # prompts of similar length together: less padding
    for k in range(0, len(ready), params.batch_size):
        batch = [ready[i] for i in by_length[k : k + params.batch_size]]
        try:
            prompt_ids, traces = generate_traced(llm, [b[2] for b in batch], state_indices, params.max_new_tokens, params.prompt.chat)
        except Exception as err:
            done.update((b[0]["id"], _failure(b[0], err)) for b in batch)
            continue
        for (base, text, _, cut, warnings), ids, trace in zip(batch, prompt_ids, traces):
            record = {**base, "cut": cut, "prompt_ids": ids, "gen_ids": trace.gen_ids, "warnings": warnings}
            try:
                labels = label_continuation(
                    llm, tools, base["title"], text, cut, trace.gen_ids, params.similarity_threshold, params.sentence_window
                )
            except Exception as err:
                done[base["id"]] = _failure(record, err)
                continue
            labels["entities"] = json.dumps(labels["entities"])
            done[base["id"]] = {**record, **labels, "status": OK, "prob": trace.prob.tolist(), "entropy": trace.entropy.tolist()}
            hidden[base["id"]] = trace.hidden
    return rows + [done[r[0]["id"]] for r in ready], hidden  # failed preparations first, then the articles in shard order


def balance(labels) -> dict:
    labels = [int(x) for x in labels]
    return {"n": len(labels), "hallucinated": sum(labels), "rate": round(sum(labels) / len(labels), 4) if labels else None}


def report(frame: pd.DataFrame) -> dict:
    """Counts, label balance per level, and what the labels would be if only the article after the cut could
    support an entity (``against_text_after_cut``: the title and prefix made those entities supported)."""
    ok = frame[frame["status"] == OK]
    per_record = [json.loads(row.entities) for row in ok.itertuples()]
    entities = [e for ents in per_record for e in ents]
    after_cut_only = [[int(e["hallucinated"] or e["support"] != "after_cut") for e in ents] for ents in per_record]
    token_labels = np.concatenate([np.asarray(t) for t in ok["token_label"]]) if len(ok) else np.zeros(0)
    return {
        **status_counts(frame),
        "continuations": {
            "all": balance(ok["label"] if len(ok) else []), **{split: balance(g["label"]) for split, g in ok.groupby("split")}
        },
        "entities": {
            **balance(e["hallucinated"] for e in entities),
            "supported_by": {part: sum(e["support"] == part for e in entities) for part in PARTS},
        },
        "against_text_after_cut": {
            "continuations": balance(max(labels) for labels in after_cut_only),
            "entities": balance(x for labels in after_cut_only for x in labels),
        },
        "tokens": {
            "generated": int(len(token_labels)),
            "entity_tokens": int((token_labels >= 0).sum()),
            "hallucinated": int((token_labels == 1).sum()),
        },
        "crossing_entities_skipped": int(ok["crossing_entities"].sum()) if len(ok) else 0,
        "warnings": int(sum(len(w) for w in frame["warnings"].dropna())) if "warnings" in frame else 0,
    }


class ShardWorker:
    """Computes and writes shards of the real-time set (records, then the hidden-state sidecar); loads the LLM, spaCy
    and the embedding model once (in the stage's process or a Ray actor)."""

    def __init__(self, llm: LLMSpec, params, store: ShardStore):
        self.llm, self.params, self.store = llm.load(), params, store
        self.state_indices = hidden_state_indices(params.hidden_layers, self.llm.fingerprint.num_layers, "build_realtime.hidden_layers")
        self.tools = EntityTools(params.spacy_model, params.embedding_model)

    def __call__(self, shard: tuple[int, pd.DataFrame]) -> pd.DataFrame:
        k, chunk = shard
        with torch.no_grad():
            rows, hidden = build_shard(self.llm, self.tools, chunk, self.state_indices, self.params)
        self.store.write_arrays(k, HIDDEN, hidden)
        records = pd.DataFrame(rows)
        self.store.write(k, records)
        return records[["id", "status"]]


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "build_realtime")
    params = p["build_realtime"]
    table = pd.read_parquet(p["paths.articles"])
    llm = LLMSpec.of(p)
    hidden_state_indices(params.hidden_layers, llm.key()["num_layers"], "build_realtime.hidden_layers")  # bad layers fail before any work
    inputs = {"articles": p["paths.articles"]}
    store, budget = open_shards("build_realtime", params, llm, inputs, LIBRARIES, p["paths.realtime_shards"], len(table))
    worker = functools.partial(ShardWorker, llm, params, store)
    run_shards(store, table, params.shard_size, worker, p["execution"], budget, "build_realtime", "article")
    write_outputs(store, len(table), params.shard_size, p["paths.realtime"], p["paths.realtime_hidden"], p["paths.realtime_report"])


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
