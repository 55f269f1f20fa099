"""Stage build_early: the early-detection set (DioR Alg. 1): answer, label and IG features per question.

Work is written in shards; a killed run resumes at the first unfinished shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from detectors.config import load_section
from detectors.early import early_record
from detectors.llm import load_llm
from detectors.shards import ShardStore, write_json
from pipelines._stage import stage_params

log = logging.getLogger("build_early")


def _record(llm, row, params) -> dict:
    base = {"id": row.id, "split": row.split, "question": row.question, "answers": list(row.answers)}
    try:
        return {**base, "status": "ok", **early_record(llm, row.question, list(row.answers), params)}
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
    data = stage_params(__doc__, argv)
    llm_params, qa_params = load_section("llm", data=data), load_section("qa", data=data)
    params = load_section("build_early", data=data)
    table = pd.read_parquet(qa_params.out)
    llm = load_llm(llm_params.dir, llm_params.dtype, llm_params.device)
    store = ShardStore(
        params.shard_dir,
        {
            "features": dataclasses.asdict(params.features),
            "max_new_tokens": params.max_new_tokens,
            "shard_size": params.shard_size,
            "llm": llm.fingerprint.to_dict(),
            "qa_table": hashlib.sha256(Path(qa_params.out).read_bytes()).hexdigest()[:16],
        },
    )
    n_shards = (len(table) + params.shard_size - 1) // params.shard_size
    todo = [k for k in range(n_shards) if not store.done(k)]
    log.info("%d questions in %d shards, %d to do (%s)", len(table), n_shards, len(todo), llm.fingerprint.name)
    with tqdm(total=len(table), initial=store.items_done(len(table), params.shard_size), desc="build_early", unit="q") as bar:
        for k in todo:
            chunk = table.iloc[k * params.shard_size : (k + 1) * params.shard_size]
            rows = []
            for row in chunk.itertuples(index=False):
                rows.append(_record(llm, row, params))
                bar.update()
            store.write(k, pd.DataFrame(rows))
    frame = store.read(range(n_shards))
    out = Path(params.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out, index=False)
    summary = report(frame)
    write_json(params.report, summary)
    log.info("done: %s", {k: v for k, v in summary.items() if k != "failures"})


if __name__ == "__main__":
    main()
