"""Stage build_realtime: the entity-hallucination set (DioR Alg. 2, App. A.2).

Each article is truncated before an entity, continued by the LLM (hidden states of every generated
token captured by the recorder while it generates), and its continuation's entities are labelled
against the original's. Work is written in shards; a killed run resumes at the first unfinished shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.numpy import load_file, save_file
from tqdm import tqdm

from detectors.config import load_section
from detectors.early import RecordError
from detectors.llm import load_llm
from detectors.realtime import EntityTools, generate_traced, label_continuation, prepare_article, realtime_positions
from detectors.shards import ShardStore, write_json
from pipelines._stage import stage_params

log = logging.getLogger("build_realtime")
HIDDEN = ".hidden.safetensors"


def _failure(base: dict, err: Exception) -> dict:
    return {**base, "status": f"{type(err).__name__}: {err}"}


def build_shard(llm, tools, chunk: pd.DataFrame, positions: list[int], params) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Records of one shard and the hidden states of their generated tokens (by record id)."""
    rows, ready = [], []
    for art in chunk.itertuples(index=False):
        base = {"id": art.id, "split": art.split, "title": art.title}
        try:
            text, prompt, cut, warnings = prepare_article(tools, llm, art.id, art.title, art.text, params)
            ready.append((base, text, prompt, cut, warnings))
        except RecordError as err:
            rows.append(_failure(base, err))
    hidden: dict[str, np.ndarray] = {}
    for i in range(0, len(ready), params.batch_size):
        batch = ready[i : i + params.batch_size]
        prompt_ids, traces = generate_traced(llm, [b[2] for b in batch], positions, params.max_new_tokens, params.prompt.chat)
        for (base, text, _, cut, warnings), ids, trace in zip(batch, prompt_ids, traces):
            record = {**base, "cut": cut, "prompt_ids": ids, "gen_ids": trace.gen_ids, "warnings": warnings}
            try:
                labels = label_continuation(llm, tools, text, cut, trace.gen_ids, params)
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
    data = stage_params(__doc__, argv)
    llm_params, articles = load_section("llm", data=data), load_section("articles", data=data)
    params = load_section("build_realtime", data=data)
    table = pd.read_parquet(articles.out)
    llm = load_llm(llm_params.dir, llm_params.dtype, llm_params.device)
    positions = realtime_positions(llm, params.hidden_layers)
    tools = EntityTools(params.spacy_model, params.embedding_model)
    config = {k: v for k, v in dataclasses.asdict(params).items() if k not in ("shard_dir", "out", "hidden_out", "report")}
    config |= {"llm": llm.fingerprint.to_dict(), "articles": hashlib.sha256(Path(articles.out).read_bytes()).hexdigest()[:16]}
    store = ShardStore(params.shard_dir, config)
    n_shards = (len(table) + params.shard_size - 1) // params.shard_size
    todo = [k for k in range(n_shards) if not store.done(k)]
    log.info("%d articles in %d shards, %d to do (%s)", len(table), n_shards, len(todo), llm.fingerprint.name)
    with tqdm(total=len(table), initial=store.items_done(len(table), params.shard_size), desc="build_realtime", unit="article") as bar:
        for k in todo:
            chunk = table.iloc[k * params.shard_size : (k + 1) * params.shard_size]
            with torch.no_grad():
                rows, hidden = build_shard(llm, tools, chunk, positions, params)
            save_file(hidden, str(store.sidecar(k, HIDDEN)))
            store.write(k, pd.DataFrame(rows))
            bar.update(len(chunk))
    write_outputs(store, n_shards, params)


def write_outputs(store: ShardStore, n_shards: int, params) -> None:
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
    for path in (params.out, params.hidden_out):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(params.out, index=False)
    width = blocks[0].shape[1] if blocks else 0
    save_file({"hidden": np.concatenate(blocks) if blocks else np.zeros((0, width), np.float16)}, params.hidden_out)
    summary = report(frame)
    write_json(params.report, summary)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "failures"})


if __name__ == "__main__":
    main()
