"""The entity-hallucination set's records (DioR Alg. 2, App. A.2): each article truncated before an entity, continued
by the LLM while the recorder catches every generated token's hidden states, and its continuation's entities labelled
against the original's (:mod:`detectors.dior.entities`); :func:`report` says how the set came out."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from detectors.dior.entities import PARTS, label_continuation, prepare_article
from detectors.dior.recorder import generate_traced
from detectors.execution import batch_or_each
from detectors.shards import OK, failure_status, status_counts


def _failure(base: dict, err: Exception) -> dict:
    return {**base, "status": failure_status(err)}


def build_records(
    llm, tools, chunk: pd.DataFrame, state_indices: list[int], params
) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Records of one shard and the hidden states of their generated tokens (by record id). A record that
    raises becomes a skipped or error row (see :mod:`detectors.shards`); a batch whose generation raises
    makes an error row of each of its records. Prompts are batched by token length (left padding wastes less)."""
    rows, ready = [], []
    for art in chunk.itertuples(index=False):
        base = {"id": art.id, "split": art.split, "title": art.title, "feature_dtype": llm.dtype_name}
        try:
            text, prompt, cut, warnings = prepare_article(
                tools,
                llm,
                art.id,
                art.title,
                art.text,
                params.prompt,
                max_new_tokens=params.max_new_tokens,
                max_article_chars=params.max_article_chars,
                prefix_sentences=params.prefix_sentences,
                min_prefix_chars=params.min_prefix_chars,
            )
            ready.append((base, text, prompt, cut, warnings))
        except Exception as err:
            rows.append(_failure(base, err))
    hidden: dict[str, np.ndarray] = {}
    lengths = [len(llm.tokenizer(r[2], add_special_tokens=not params.prompt.chat)["input_ids"]) for r in ready]
    done: dict[str, dict] = {}
    by_length = sorted(range(len(ready)), key=lengths.__getitem__)  # prompts of similar length together: less padding

    def continue_all(group: list) -> list:
        prompts = [b[2] for b in group]
        ids, traces = generate_traced(llm, prompts, state_indices, params.max_new_tokens, params.prompt.chat)
        return list(zip(ids, traces))

    for k in range(0, len(ready), params.batch_size):
        batch = [ready[i] for i in by_length[k : k + params.batch_size]]
        for (base, text, _, cut, warnings), generated in zip(
            batch, batch_or_each(continue_all, batch, "build_realtime: a batch")
        ):
            if isinstance(generated, Exception):
                done[base["id"]] = _failure(base, generated)
                continue
            ids, trace = generated
            record = {**base, "cut": cut, "prompt_ids": ids, "gen_ids": trace.gen_ids, "warnings": warnings}
            try:
                labels = label_continuation(
                    llm,
                    tools,
                    base["title"],
                    text,
                    cut,
                    trace.gen_ids,
                    params.similarity_threshold,
                    params.sentence_window,
                )
            except Exception as err:
                done[base["id"]] = _failure(record, err)
                continue
            labels["entities"] = json.dumps(labels["entities"])
            done[base["id"]] = {
                **record,
                **labels,
                "status": OK,
                "prob": trace.prob.tolist(),
                "entropy": trace.entropy.tolist(),
            }
            hidden[base["id"]] = trace.hidden
    return rows + [
        done[r[0]["id"]] for r in ready
    ], hidden  # failed preparations first, then the articles in shard order


def balance(labels) -> dict:
    labels = [int(x) for x in labels]
    return {
        "n": len(labels),
        "hallucinated": sum(labels),
        "rate": round(sum(labels) / len(labels), 4) if labels else None,
    }


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
            "all": balance(ok["label"] if len(ok) else []),
            **{split: balance(g["label"]) for split, g in ok.groupby("split")},
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
