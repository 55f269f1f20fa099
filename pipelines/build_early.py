"""Stage build_early: the early-detection set (DioR Alg. 1): answer, label and IG features per question.

Work is written in shards; a killed run resumes at the first unfinished shard.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pandas as pd
import torch

from detectors.dior.early import early_record
from detectors.io import file_digest, write_json
from detectors.llm.loading import load_llm
from detectors.shards import ShardStore
from pipelines._stage import run, stage_params

log = logging.getLogger("build_early")
READS = ("llm", "build_early", "paths.llm", "paths.qa", "paths.early_shards", "paths.early", "paths.early_report")


def _record(llm, row, params) -> dict:
    base = {"id": row.id, "split": row.split, "question": row.question, "answers": list(row.answers), "feature_dtype": llm.dtype_name}
    try:
        record = early_record(llm, row.question, list(row.answers), params.features, params.max_new_tokens, params.stop)
        return {**base, "status": "ok", **record}
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # one bad record is reported, never the end of the run
        return {**base, "status": f"{type(err).__name__}: {err}"}


def report(frame: pd.DataFrame) -> dict:
    ok = frame[frame["status"] == "ok"]
    by_split = {
        split: {"n": int(len(g)), "hallucinated": int(g["label"].sum()), "rate": round(float(g["label"].mean()), 4)}
        for split, g in ok.groupby("split")
    }
    failed = frame[frame["status"] != "ok"]
    return {
        "records": int(len(frame)),
        "ok": int(len(ok)),
        "failed": int(len(failed)),
        "failures": failed[["id", "status"]].head(50).to_dict("records"),
        "label_balance": by_split,
        "hallucination_rate": round(float(ok["label"].mean()), 4) if len(ok) else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = stage_params(__doc__, argv, READS, "build_early")
    llm_params, params = p["llm"], p["build_early"]
    table = pd.read_parquet(p["paths.qa"])
    llm = load_llm(p["paths.llm"], llm_params.dtype, llm_params.device)
    store = ShardStore(
        p["paths.early_shards"],
        {
            "features": dataclasses.asdict(params.features),
            "max_new_tokens": params.max_new_tokens,
            "shard_size": params.shard_size,
            "llm": llm.fingerprint.to_dict(),
            "qa_table": file_digest(p["paths.qa"]),
        },
    )
    log.info("LLM %s", llm.fingerprint.name)
    for k, chunk in store.pending(table, params.shard_size, "build_early", "q"):
        store.write(k, pd.DataFrame([_record(llm, row, params) for row in chunk.itertuples(index=False)]))
    frame = store.read_all(len(table), params.shard_size)
    out = Path(p["paths.early"])
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out, index=False)
    summary = report(frame)
    write_json(p["paths.early_report"], summary)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "failures"})


if __name__ == "__main__":
    run(main)
