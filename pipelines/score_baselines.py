"""Stage score_baselines: the training-free baselines that need the LLM, scored once for evaluate.

- RetroRAG's evaluator on the early set → ``paths.baselines_early`` (``id`` and two columns):
  ``retrorag_self_consistency``, Eq. 1: ``P(yes) / (P(yes) + P(no))`` that the LLM's answer and a second answer
  sampled from the same question prompt (``retrorag``: its temperature, seed and M_sc prompt) have the same meaning;
  ``retrorag_self_evaluation``: the same evaluator asked whether the LLM's own answer is correct
  (``score_baselines.evaluator``);
- DRAGIN's RIND on the real-time set, computed as the RAG loop's trigger computes it
  (:func:`~detectors.baselines.rind.rind_scores`: the prompt's states, the continuation once more with eager attention,
  the entropies recorded at generation) → ``paths.baselines_realtime`` (``id``, ``rind``: one float per generated
  token, aligned with the record's ``prob``/``entropy``).

Only records with status ``ok``. ``paths.score_baselines_metrics`` says what it cost: seconds, seconds per
record, and tokens/s of RIND against a plain sdpa forward over the same batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd
import torch

from detectors.baselines.retrorag import CONSISTENCY, self_consistency_scores, self_evaluation_scores
from detectors.baselines.retrorag import NAME as RETRORAG
from detectors.baselines.rind import NAME as RIND
from detectors.baselines.rind import rind_scores
from detectors.errors import InputError
from detectors.io import write_json
from detectors.llm.kv import forward_rows
from detectors.llm.layers import attention_implementation
from detectors.llm.loading import load_llm
from detectors.llm.words import spacy_stopwords
from detectors.progress import progress
from detectors.sources.ids import ok_records
from pipelines._stage import run, stage_params

log = logging.getLogger("score_baselines")
READS = (
    "llm",
    "score_baselines",
    "retrorag",
    "build_early.features.prompt",
    "build_realtime.spacy_model",
    "paths.llm",
    "paths.early",
    "paths.realtime",
    "paths.baselines_early",
    "paths.baselines_realtime",
    "paths.score_baselines_metrics",
)
DEPS = (
    "${paths.llm}",
    "${paths.early}",
    "${paths.realtime}",
)
OUTS = (
    "${paths.baselines_early}",
    "${paths.baselines_realtime}",
    ("${paths.score_baselines_metrics}", {"cache": False}),
)


def read_ok(path: str, columns: list[str]) -> pd.DataFrame:
    """The records of the set at ``path`` built without error (:func:`~detectors.sources.ids.ok_records`), every split;
    a set without ``columns`` is an :class:`InputError` saying to rebuild it."""
    frame = pd.read_parquet(path)
    missing = [c for c in ["id", "status", *columns] if c not in frame.columns]
    if missing:
        raise InputError(f"{path} has no column(s) {missing}: rebuild it with the current build stage (dvc repro)")
    return ok_records(frame, None).reset_index(drop=True)


def score_early(llm, frame: pd.DataFrame, params, retrorag, prompt) -> pd.DataFrame:
    """RetroRAG's two question-level scores of the early set's answers (``prompt``: the question prompt they were
    given with)."""
    ev = params.evaluator
    questions, answers = list(frame["question"]), list(frame["answer"])
    with progress(total=len(questions), desc="retrorag self-evaluation", unit="question") as bar:
        evaluation = self_evaluation_scores(
            llm,
            list(zip(questions, answers)),
            ev.template,
            ev.chat,
            tuple(ev.yes_words),
            tuple(ev.no_words),
            params.batch_size,
            bar,
        )
    with progress(total=len(questions), desc="retrorag self-consistency (Eq. 1)", unit="question") as bar:
        consistency = self_consistency_scores(llm, questions, answers, retrorag, prompt, params.batch_size, bar)
    return pd.DataFrame({"id": frame["id"], RETRORAG: evaluation, CONSISTENCY: consistency})


def score_realtime(llm, frame: pd.DataFrame, stopwords: frozenset[str], batch_size: int) -> pd.DataFrame:
    """RIND per record, from the entropies recorded when its continuation was generated (the loop's computation)."""
    prompts, gens = [list(p) for p in frame["prompt_ids"]], [list(g) for g in frame["gen_ids"]]
    with progress(total=len(prompts), desc="rind", unit="continuation") as bar:
        traces = rind_scores(llm, prompts, gens, list(frame["entropy"]), stopwords, batch_size, bar)
    return pd.DataFrame({"id": frame["id"], RIND: [t.rind.tolist() for t in traces]})


def pass_speeds(llm, frame: pd.DataFrame, stopwords: frozenset[str], batch_size: int) -> dict:
    """Tokens/s of RIND (the prompts' prefill and the continuations' eager pass) and of a plain sdpa forward (all
    logits) over the same batch."""
    rows = frame.head(batch_size)
    prompts, gens = [list(p) for p in rows["prompt_ids"]], [list(g) for g in rows["gen_ids"]]
    tokens = sum(len(p) + len(g) for p, g in zip(prompts, gens))
    start = time.perf_counter()
    rind_scores(llm, prompts, gens, list(rows["entropy"]), stopwords, batch_size)
    rind = time.perf_counter() - start
    with attention_implementation(llm.model, "sdpa"):
        start = time.perf_counter()
        forward_rows(llm, None, [p + g for p, g in zip(prompts, gens)], logits=True)
        sdpa = time.perf_counter() - start
    return {
        "batch_rows": len(rows),
        "batch_tokens": tokens,
        "rind_tokens_per_s": round(tokens / rind, 1),
        "sdpa_forward_tokens_per_s": round(tokens / sdpa, 1),
        "rind_over_sdpa_time": round(rind / sdpa, 2),
    }


def main(argv: list[str] | None = None) -> None:
    params = stage_params(__doc__, argv, READS, "score_baselines")
    llm_params, baselines = params["llm"], params["score_baselines"]
    early = read_ok(params["paths.early"], ["question", "answer"])
    realtime = read_ok(params["paths.realtime"], ["prompt_ids", "gen_ids", "entropy"])
    stopwords = spacy_stopwords(params["build_realtime.spacy_model"], "build_realtime.spacy_model")
    llm = load_llm(params["paths.llm"], llm_params.dtype, llm_params.device)
    seconds = {}
    with torch.no_grad():
        start = time.perf_counter()
        early_scores = score_early(llm, early, baselines, params["retrorag"], params["build_early.features.prompt"])
        seconds["retrorag"] = time.perf_counter() - start
        start = time.perf_counter()
        realtime_scores = score_realtime(llm, realtime, stopwords, baselines.batch_size)
        seconds["rind"] = time.perf_counter() - start
        speeds = pass_speeds(llm, realtime, stopwords, baselines.batch_size) if len(realtime) else {}
    for key, table in (("paths.baselines_early", early_scores), ("paths.baselines_realtime", realtime_scores)):
        Path(params[key]).parent.mkdir(parents=True, exist_ok=True)
        table.to_parquet(params[key], index=False)
    tokens = int(sum(len(a) + len(b) for a, b in zip(realtime["prompt_ids"], realtime["gen_ids"])))
    metrics = {
        "device": str(llm.device),
        "dtype": llm.dtype_name,
        "retrorag": {
            "records": len(early),
            "seconds": round(seconds["retrorag"], 2),
            "seconds_per_record": round(seconds["retrorag"] / max(len(early), 1), 4),
        },
        "rind": {
            "records": len(realtime),
            "tokens": tokens,
            "seconds": round(seconds["rind"], 2),
            "seconds_per_record": round(seconds["rind"] / max(len(realtime), 1), 4),
            "tokens_per_s": round(tokens / max(seconds["rind"], 1e-9), 1),
            **speeds,
        },
    }
    write_json(params["paths.score_baselines_metrics"], metrics)
    log.info("done: %s", metrics)


if __name__ == "__main__":
    run(main)
