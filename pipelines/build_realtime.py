"""Stage build_realtime: the entity-hallucination set (DioR Alg. 2, App. A.2).

Each article is truncated before an entity, continued by the LLM (hidden states of every generated
token captured by the recorder while it generates), and its continuation's entities are labelled
against the original's. Work is written in shards; a killed run resumes at the first unfinished shard.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.numpy import load_file, save_file

from detectors.dior.entities import EntityTools, label_continuation, prepare_article
from detectors.dior.recorder import generate_traced
from detectors.errors import RecordError
from detectors.io import file_digest, write_json
from detectors.llm.layers import hidden_state_indices
from detectors.llm.loading import load_llm
from detectors.shards import ShardStore
from pipelines._stage import run, stage_params

log = logging.getLogger("build_realtime")
READS = (
    "llm", "build_realtime", "paths.llm", "paths.articles", "paths.realtime_shards", "paths.realtime",
    "paths.realtime_hidden", "paths.realtime_report",
)  # fmt: skip
HIDDEN = ".hidden.safetensors"


def _failure(base: dict, err: Exception) -> dict:
    return {**base, "status": f"{type(err).__name__}: {err}"}


def build_shard(llm, tools, chunk: pd.DataFrame, state_indices: list[int], params) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Records of one shard and the hidden states of their generated tokens (by record id)."""
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
        except RecordError as err:
            rows.append(_failure(base, err))
    hidden: dict[str, np.ndarray] = {}
    for i in range(0, len(ready), params.batch_size):
        batch = ready[i : i + params.batch_size]
        prompt_ids, traces = generate_traced(llm, [b[2] for b in batch], state_indices, params.max_new_tokens, params.prompt.chat)
        for (base, text, _, cut, warnings), ids, trace in zip(batch, prompt_ids, traces):
            record = {**base, "cut": cut, "prompt_ids": ids, "gen_ids": trace.gen_ids, "warnings": warnings}
            try:
                labels = label_continuation(llm, tools, text, cut, trace.gen_ids, params.similarity_threshold, params.sentence_window)
            except RecordError as err:
                rows.append(_failure(record, err))
                continue
            labels["entities"] = json.dumps(labels["entities"])
            rows.append({**record, **labels, "status": "ok", "prob": trace.prob.tolist(), "entropy": trace.entropy.tolist()})
            hidden[base["id"]] = trace.hidden
    return rows, hidden


def report(frame: pd.DataFrame) -> dict:
    ok = frame[frame["status"] == "ok"]
    entities = [e for row in ok.itertuples() for e in json.loads(row.entities)]
    token_labels = np.concatenate([np.asarray(t) for t in ok["token_label"]]) if len(ok) else np.zeros(0)
    failed = frame[frame["status"] != "ok"]
    return {
        "records": int(len(frame)),
        "ok": int(len(ok)),
        "failed": int(len(failed)),
        "failure_reasons": failed["status"].str.replace(r"\d+", "N", regex=True).value_counts().to_dict() if len(failed) else {},
        "failures": failed[["id", "status"]].head(50).to_dict("records"),
        "continuations": {
            split: {"n": int(len(g)), "hallucinated": int(g["label"].sum()), "rate": round(float(g["label"].mean()), 4)}
            for split, g in ok.groupby("split")
        },
        "entities": {"n": len(entities), "hallucinated": int(sum(e["hallucinated"] for e in entities))},
        "tokens": {
            "generated": int(len(token_labels)),
            "entity_tokens": int((token_labels >= 0).sum()),
            "hallucinated": int((token_labels == 1).sum()),
        },
        "crossing_entities_skipped": int(ok["crossing_entities"].sum()) if len(ok) else 0,
        "warnings": int(sum(len(w) for w in frame["warnings"].dropna())) if "warnings" in frame else 0,
    }


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "build_realtime")
    llm_params, params = p["llm"], p["build_realtime"]
    table = pd.read_parquet(p["paths.articles"])
    llm = load_llm(p["paths.llm"], llm_params.dtype, llm_params.device)
    state_indices = hidden_state_indices(params.hidden_layers, llm.fingerprint.num_layers, "build_realtime.hidden_layers")
    tools = EntityTools(params.spacy_model, params.embedding_model)
    config = dataclasses.asdict(params) | {"llm": llm.fingerprint.to_dict(), "articles": file_digest(p["paths.articles"])}
    store = ShardStore(p["paths.realtime_shards"], config)
    log.info("LLM %s", llm.fingerprint.name)
    for k, chunk in store.pending(table, params.shard_size, "build_realtime", "article"):
        with torch.no_grad():
            rows, hidden = build_shard(llm, tools, chunk, state_indices, params)
        save_file(hidden, str(store.sidecar(k, HIDDEN)))
        store.write(k, pd.DataFrame(rows))
    write_outputs(store, ShardStore.count(len(table), params.shard_size), p["paths.realtime"], p["paths.realtime_hidden"], p["paths.realtime_report"])


def write_outputs(store: ShardStore, n_shards: int, out: str, hidden_out: str, report_path: str) -> None:
    """One table and one float16 tensor of all generated tokens' hidden states (rows ``hidden_offset`` on)."""
    frames, blocks, offset = [], [], 0
    for k in range(n_shards):
        shard, hidden = store.read(range(k, k + 1)), load_file(str(store.sidecar(k, HIDDEN)))
        offsets = []
        for row in shard.itertuples():
            offsets.append(offset if row.status == "ok" else -1)
            if row.status == "ok":
                blocks.append(hidden[row.id])
                offset += len(hidden[row.id])
        frames.append(shard.assign(hidden_offset=offsets))
    frame = pd.concat(frames, ignore_index=True)
    for path in (out, hidden_out):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out, index=False)
    width = blocks[0].shape[1] if blocks else 0
    save_file({"hidden": np.concatenate(blocks) if blocks else np.zeros((0, width), np.float16)}, hidden_out)
    summary = report(frame)
    write_json(report_path, summary)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "failures"})


if __name__ == "__main__":
    run(main)
