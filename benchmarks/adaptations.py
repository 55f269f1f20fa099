"""What a stated adaptation moves: a configuration of ``rag_eval`` answered with one of its choices changed, beside
the same configuration as the pipeline runs it, on the same test questions, at the same operating thresholds (the
last ``rag_eval``'s), in one run.

What it reports
---------------
For each variant of ``VARIANTS`` and each corpus: the accuracy and retrievals per question of the configuration as
configured and of the variant, the paired accuracy difference (variant − configured) with its 95% bootstrap interval
over the questions, and how many questions changed correctness each way. A variant changes one choice of one
trigger family (its policy, say); the thresholds stay the configured ones, so the difference is the choice's at
that operating point, not after tuning each.

Variants:

* ``flare-rescore``: FLARE's rule before 2026-11-26: the sentence generated again after a retrieval is scored again
  (up to ``max_retrievals`` retrievals on one sentence) and the passages stay in the prompt for the sentences after
  it; the configured rule (FLARE §3, DRAGIN's released TokenRAG) accepts the regenerated sentence and uses its
  passages for that sentence only.

Run: ``python -m benchmarks.adaptations [--variants flare-rescore] [--questions N] [--out benchmarks/results/adaptations_cpu.json]``
after ``dvc repro rag_eval``; nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def _flare_rescore(trigger):
    return dataclasses.replace(trigger, policy=dataclasses.replace(trigger.policy, after_retrieval="rescore", passages="keep"))


# variant -> (configuration, trigger spec it changes, how, what it is)
VARIANTS: dict[str, tuple[str, str, Callable, str]] = {
    "flare-rescore": ("flare", "flare", _flare_rescore, "the regenerated sentence scored again, its passages kept (before 2026-11-26)"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--questions", type=int, default=None, help="the first N of rag_eval's test questions (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/adaptations_cpu.json"))
    args = parser.parse_args(argv)

    import pandas as pd

    from detectors.evaluation.bootstrap import paired_mean_delta
    from detectors.rag.answer_metrics import accuracy, summarise
    from pipelines import rag_eval as stage
    from pipelines._rag_runtime import RagRuntime
    from pipelines._stage import stage_params

    p = stage_params(stage.__doc__, ["--params", args.params], stage.READS, "rag_eval")
    rag = p["rag_eval"]
    metrics = Path(p["paths.rag_metrics"])
    if not metrics.exists():
        raise SystemExit(f"{metrics} is missing: run `dvc repro rag_eval` first (the variants run at the thresholds it chose)")
    thresholds = json.loads(metrics.read_text())["thresholds"]
    rows = stage.split_questions(pd.read_parquet(p["paths.qa"]), "test", rag.questions)
    rows = rows.head(args.questions) if args.questions else rows
    questions, refs = list(rows["question"]), [list(a) for a in rows["answers"]]
    runtime = RagRuntime(p)
    out = {"llm": runtime.llm.fingerprint.name, "dtype": runtime.llm.dtype_name, "questions": len(questions), "variants": {}}
    for variant in args.variants:
        name, spec, change, what = VARIANTS[variant]
        config = rag.configurations[name]
        out["variants"][variant] = {"configuration": name, "what": what, "corpora": {}}
        for corpus in rag.corpora:
            own = thresholds[corpus][name]
            configured = runtime.loop(name, config, corpus, own)[0](questions, [False] * len(questions))
            runtime._triggers[spec] = change(runtime.trigger(spec, corpus))  # the variant: the runtime's one built trigger of that spec
            try:
                varied = runtime.loop(name, config, corpus, own)[0](questions, [False] * len(questions))
            finally:
                del runtime._triggers[spec]  # built again as configured by the next call
            runtime.forget_states()
            a, b = summarise(configured, refs), summarise(varied, refs)
            right = [[accuracy(line["answer"], r) for line, r in zip(lines, refs)] for lines in (configured, varied)]
            delta, low, high = paired_mean_delta(right[1], right[0], rag.bootstrap, rag.seed)
            result = {"thresholds": own, "accuracy": a["accuracy"], "variant_accuracy": b["accuracy"], "delta": delta, "ci_low": low, "ci_high": high,
                      "retrievals_per_question": a["retrievals_per_question"], "variant_retrievals_per_question": b["retrievals_per_question"],
                      "became_right": int(sum(y > x for x, y in zip(*right))), "became_wrong": int(sum(y < x for x, y in zip(*right)))}  # fmt: skip
            out["variants"][variant]["corpora"][corpus] = result
            print(f"{variant} · {corpus}: {a['accuracy']:.3f} → {b['accuracy']:.3f} ({delta:+.3f} [{low:+.3f}, {high:+.3f}]), retrievals "
                  f"{a['retrievals_per_question']:.2f} → {b['retrievals_per_question']:.2f}", file=sys.stderr, flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
