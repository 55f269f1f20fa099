"""What a stated adaptation moves: one of a system's choices changed to the paper's (or its released code's), beside
the system as ``rag_eval`` runs it, on the same validation questions, in one run (after ``dvc repro rag_eval``: the
variants read its thresholds and registered detectors). A research measurement reads no test question: the test split
is read once, by the stages that write the results, so an adaptation adopted or rejected from these numbers never saw
the questions it is reported on.

Two kinds of variants
---------------------
* **Procedure** variants (``PROCEDURES``) change what a configuration does once it retrieves (its policy, its query):
  the configuration answers every corpus's validation questions as configured and with the change, both at the
  thresholds ``rag_eval`` chose for it on validation. Reported: accuracy and retrievals per question of each, the paired
  accuracy difference (variant - configured) with its 95% bootstrap interval over the questions, and how many
  questions changed correctness each way.
* **Score** variants (``SCORES``) change how a trigger scores tokens: a threshold chosen for one score means nothing
  for the other, so both are compared as the sweep compares triggers (``docs/rag.md``, "Curves"): each one's accuracy
  vs retrieval-rate curve on the sweep corpus's validation questions (one retrieval at the first crossing, the question
  as
  the query, no steering), its area, and the paired 95% interval of the area difference (variant - configured).

Variants:

* ``flare-rescore`` (procedure): FLARE's rule before 2026-11-26: the sentence generated again after a retrieval is
  scored again (up to ``max_retrievals`` on one sentence) and its passages stay for the sentences after it; the
  configured rule (FLARE §3, DRAGIN's released TokenRAG) accepts the regenerated sentence and uses its passages for
  that sentence only.
* ``ctrla-tvq`` (procedure): CtrlA's targeted validation query (Prompt B.1, the released runs' ``--use_tvq``): the
  LLM writes a search query from the question and the flagged segment, and the query is the question followed by it
  (Table 7's "q + f_TVQ"); configured: Eq. 3's masked segment after the question (f_CAQ).
* ``dragin-qfs-released`` (procedure): DRAGIN's query as the released code forms it: the attention row of the token
  before the flagged one, its top 25 content tokens (the released code keeps 25-35 words); configured: the flagged
  token's own row, its top 8 (``rag_eval.query_settings.qfs.top_n``).
* ``sit-spacy-entities`` (procedure): Stitch-in-Time's concepts as they were before 2026-11-26: spaCy's entities of
  the segment; configured (``rag_eval.settings.sit.concepts: llm``): the paper's preferred technique (§2.1.1), the
  keyphrases the LLM names when instructed (Table 3).
* ``sit-repair-instruction`` (procedure): Stitch-in-Time's repair (§2.2, Table 3): the evidence, the hallucinated
  sentence and the instruction to repair it, before the question the answer continues; configured: the evidence
  alone (``rag_eval.context``), the segment generated again.
* ``ctrla-released-scale`` (score): Eq. 2 as the released code computes it (``confidence_monitor`` in
  ``code/model/utils.py``): projections further than 5 standard deviations from the sequence's median replaced by the
  median, ``(x - tau)`` divided by the standard deviation of the sequence from its 6th position, *not centred*,
  clipped to ``±max(0.3, std(|x|)/10)``, and every score at or above 0 set to that bound (only the unconfident
  tokens keep their order); configured: the paper's running z-score (:func:`detectors.ctrla.monitor.running_scores`).
* ``rind-generated-only`` (score): RIND's attention from the generated segment run alone (DRAGIN's released
  ``generate_attn``: ``model(generated_tokens, output_attentions=True)``); configured: the segment's attention within
  the loop's pass over prompt + segment, over the segment's own tokens.

Run:
``python -m benchmarks.adaptations [--variants ...] [--questions N] [--out benchmarks/results/adaptations_cpu.json]``
after ``dvc repro rag_eval``; nothing else on the machine meanwhile. A variant already in ``--out`` is kept unless it
is run again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import spacy

from detectors.baselines.rind import rind_on_kv
from detectors.llm.generate import generate, instruction_prompt
from detectors.llm.kv import crop_kv
from detectors.rag.controllers.validation import ValidateAndRepair
from detectors.rag.families.ctrla import CtrlACalculator
from detectors.rag.families.rind import RindCalculator
from detectors.rag.families.sit import EntityCalculator
from detectors.rag.queries import QfsQuery, qfs_query
from detectors.rag.runtime import RagRuntime

ROOT = Path(__file__).resolve().parents[1]

# ---- the paper's (or released code's) choices, for measurement only -----------------------------------------


def released_scale(x: np.ndarray, tau: float = 0.0, skip: int = 5) -> np.ndarray:
    """CtrlA's released ``confidence_monitor`` normalisation of a sequence's layer-mean projections ``x`` (see the
    module's docstring): confident tokens (>= 0) all score the clipping bound, unconfident ones keep their value."""
    x = np.asarray(x, dtype=np.float64).copy()
    median, std = np.median(x), x.std()
    x[np.abs(x - median) > 5 * std] = median
    bound = max(0.3, float(np.abs(x).std()) / 10)
    s = x - tau
    spread = s[skip:].std() if len(s) > skip else s.std()
    s = np.clip(s / spread if spread > 0 else s, -bound, bound)
    return np.where(s >= 0, bound, s)


class ReleasedScaleCalculator(CtrlACalculator):
    """``ctrla_released``: minus :func:`released_scale` of every generated token (a hallucination score, as
    ``ctrla_confidence`` is minus Eq. 2), over the probe's projections of context + segment, as the released code
    scores the whole text after each segment."""

    key, provides = "ctrla_released", ("ctrla_released",)

    def segments(self, views) -> None:
        for v in views:
            pooled = v.probes[self.key].cpu().numpy().mean(-1)
            v.stats["ctrla_released"] = -released_scale(pooled, self.params.tau)[len(v.context_ids) :]


class GeneratedOnlyRindCalculator(RindCalculator):
    """``rind_generated``: RIND with the attention of the segment run alone (no prompt, no kept answer before it), the
    entropies those the loop recorded as each token was chosen (as the released code takes them from generation)."""

    key, provides = "rind_generated", ("rind_generated",)

    def segments(self, views) -> None:
        alone = [crop_kv(v.kv, 0) for v in views]
        traces = rind_on_kv(
            self.llm, alone, [v.gen_ids for v in views], [v.stats["entropy"] for v in views], self.stopwords
        )
        for v, trace in zip(views, traces):
            v.stats["rind_generated"] = trace.rind


# CtrlA's Prompt B.1 with the two exemplars the paper prints
TVQ = (
    "Given a question and its corresponding answer segment, your task is to generate a search query based on the "
    "answer to verify its correctness by following the guidelines:\n1. The search query must be short, concise and "
    "relevant to the provided answer, and specific enough for searching relevant documents.\n2. Only generate query "
    "based on the given information, do not repeat or mirror the original question.\n3. Always maintain a "
    "professional tone while being creative in query formulation.\nExemplars:\n"
    "Question: What is Franz Seitz Sr.'s occupation?\nAnswer: Franz Seitz Sr.'s occupation is not specified in the "
    "given content.\nSearch query: What was Franz Seitz Sr.'s profession?\n"
    "Question: When did Toronto host the MLB all-star game?\nAnswer: Toronto has hosted the Major League Baseball "
    "(MLB) All-Star Game several times throughout its history.\nSearch query: What years did Toronto host the MLB "
    "All-Star Game?\nQuestion: {question}\nAnswer: {answer}\nSearch query:"
)


@dataclasses.dataclass(frozen=True)
class TvqQuery:
    """CtrlA's f_TVQ: the question followed by the search query the LLM writes (greedily, its first line) from the
    question and the flagged segment; the question alone before anything is generated. ``chat`` and ``tokens`` as the
    refusal handling's rewrite (``rag_eval.settings.ctrla-confidence``)."""

    chat: bool
    tokens: int
    name: str = "ctrla-tvq"
    needs: tuple[str, ...] = ()

    def formulate_all(self, llm, inputs) -> list[str]:
        asked = [i for i, q in enumerate(inputs) if q.segment is not None and q.segment.text.strip()]
        prompts = [
            instruction_prompt(
                llm, TVQ.format(question=inputs[i].question.strip(), answer=inputs[i].segment.text.strip()), self.chat
            )
            for i in asked
        ]
        written = {
            i: g.text.strip().strip("\"'")
            for i, g in zip(asked, generate(llm, prompts, self.tokens, add_special_tokens=not self.chat))
        }
        return [f"{q.question.strip()} {written.get(i, '')}".strip() for i, q in enumerate(inputs)]


@dataclasses.dataclass(frozen=True)
class ReleasedQfsQuery(QfsQuery):
    """DRAGIN's QFS as the released code reads it: the attention row of the token before the flagged one, the top 25
    tokens (the released code keeps 25-35 words); configured: the flagged token's own row, the top 8."""

    top_n: int = 25
    name: str = "qfs-released"

    def _with_attention(self, llm, q, context: list[int], attention) -> str:
        # causal: row i-1 of the same matrix
        return qfs_query(llm, context, max(len(context) - 2, 0), self.top_n, self.stopwords, attention)


SIT_REPAIR = (
    "{passages}\n{sentence}\nThe above sentence has information that can not be verified from the provided evidence, "
    "repair that "
    "incorrect information and create a new sentence based on the provided evidence.\n"
)
# Stitch-in-Time's Table 3, "Repair Hallucinated Sentence" (as the block before the question, where every RAG prompt
# here puts the evidence, so that the answer continues the question)


@dataclasses.dataclass(frozen=True)
class RepairWithInstruction(ValidateAndRepair):
    """Stitch-in-Time's validation whose repair prompt shows the evidence, the hallucinated sentence (question and
    segment) and Table 3's repair instruction before the question (``SIT_REPAIR``); configured: the evidence under
    ``rag_eval.context``."""

    def repair(self, loop, fire, hits, query: str) -> None:
        sentence = f"{fire.row.question.strip()} {fire.view.text.strip()}"
        loop.set_prompt(fire.row, hits, query, context=SIT_REPAIR.replace("{sentence}", sentence))
        self.after_retrieval(fire)


# ---- the variants --------------------------------------------------------------------------------------------


def _flare_rescore(trigger, runtime):
    return dataclasses.replace(
        trigger, policy=dataclasses.replace(trigger.policy, after_retrieval="rescore", passages="keep")
    )


def _tvq(query, runtime):
    refusal = runtime.params.settings["ctrla-confidence"]
    return TvqQuery(refusal["chat"], refusal["query_tokens"])


def _released_qfs(query, runtime):
    return ReleasedQfsQuery(stopwords=query.stopwords)


def _spacy_entities(trigger, runtime):
    return dataclasses.replace(
        trigger,
        scorer=dataclasses.replace(trigger.scorer, spans="entities"),
        calculators=(EntityCalculator(runtime.llm, spacy.load(runtime.stage_params["build_realtime.spacy_model"])),),
    )


def _repair_instruction(trigger, runtime):
    return dataclasses.replace(trigger, controller=RepairWithInstruction(trigger.controller.validator))


def _beside(trigger, suffix: str, calculator):
    """The variant trigger of a score variant: its own name and the one statistic ``calculator`` provides, to be swept
    beside ``trigger`` (the same policy and threshold range)."""
    name = f"{trigger.name}:{suffix}"
    (stat,) = calculator.provides
    return dataclasses.replace(
        trigger, name=name, scorer=dataclasses.replace(trigger.scorer, name=name, stat=stat), calculators=(calculator,)
    )


def _released_scale(trigger, runtime):
    return _beside(trigger, "released-scale", ReleasedScaleCalculator(trigger.calculators[0].detector))


def _generated_only(trigger, runtime):
    base = trigger.calculators[0]
    return _beside(trigger, "generated-only", GeneratedOnlyRindCalculator(base.llm, base.stopwords))


@dataclasses.dataclass(frozen=True)
class Procedure:
    configuration: str
    what: str
    trigger: tuple[str, Callable] | None = None  # (trigger spec, its change)
    query: Callable | None = None  # the configuration's query formulation, changed


@dataclasses.dataclass(frozen=True)
class Score:
    trigger: str  # the configured trigger's spec
    change: Callable  # -> the variant trigger (another name, another statistic)
    what: str


PROCEDURES = {
    "flare-rescore": Procedure(
        "flare",
        "the regenerated sentence scored again, its passages kept (before 2026-11-26)",
        trigger=("flare", _flare_rescore),
    ),
    "ctrla-tvq": Procedure(
        "ctrla",
        "the query: the question and the LLM's targeted validation query (Prompt B.1) instead of Eq. 3's masked "
        "segment",
        query=_tvq,
    ),
    "dragin-qfs-released": Procedure(
        "dragin",
        "QFS from the attention row of the token before the flagged one, 25 tokens (the released code)",
        query=_released_qfs,
    ),
    "sit-spacy-entities": Procedure(
        "sit",
        "concepts: spaCy's entities of the segment instead of the keyphrases the LLM names (before 2026-11-26)",
        trigger=("sit", _spacy_entities),
    ),
    "sit-repair-instruction": Procedure(
        "sit",
        "the repair: evidence, sentence and Table 3's repair instruction instead of the evidence alone",
        trigger=("sit", _repair_instruction),
    ),
}
SCORES = {
    "ctrla-released-scale": Score(
        "ctrla-confidence@champion",
        _released_scale,
        "Eq. 2 as the released code scales it: not centred, whole-sequence spread",
    ),
    "rind-generated-only": Score(
        "rind", _generated_only, "RIND's attention from the segment run alone (the released generate_attn)"
    ),
}


class VariantRuntime(RagRuntime):
    """The stage's runtime with one variant's changes: a trigger built from a spec of ``changes`` comes out changed
    (a procedure variant), one built from ``<spec>#variant`` with a spec of ``variants`` is the variant trigger beside
    the configured one (a score variant's sweep), and the query formulation passes through ``query_change``."""

    def __init__(self, params):
        super().__init__(params)
        self.changes: dict[str, Callable] = {}
        self.variants: dict[str, Callable] = {}
        self.query_change: Callable | None = None

    def trigger(self, spec: str, corpus: str, thresholds: dict[str, float] | None = None):
        base, variant, _ = spec.partition("#variant")
        trigger = super().trigger(base, corpus, thresholds)
        change = self.variants[base] if variant else self.changes.get(base)
        return change(trigger, self) if change else trigger

    def query(self, name: str, triggers: list, retriever):
        q = super().query(name, triggers, retriever)
        return self.query_change(q, self) if self.query_change else q


def run_procedure(runtime: VariantRuntime, variant: Procedure, rag, thresholds, questions, refs) -> dict[str, Any]:
    """The configuration as configured and with the variant's change, on every corpus, at its chosen thresholds."""
    from detectors.evaluation.answer_metrics import accuracy, summarise
    from detectors.evaluation.bootstrap import paired_mean_delta

    out = {}
    for corpus in rag.corpora:
        own = thresholds[corpus][variant.configuration]
        answered = []
        for changed in (False, True):
            runtime.changes = dict([variant.trigger]) if changed and variant.trigger else {}
            runtime.query_change = variant.query if changed else None
            answered.append(
                runtime.configuration(variant.configuration, corpus, own).answer(questions, [False] * len(questions))
            )
        runtime.changes, runtime.query_change = {}, None
        runtime.forget_shared()
        a, b = (summarise(lines, refs) for lines in answered)
        right = [[accuracy(line["answer"], r) for line, r in zip(lines, refs)] for lines in answered]
        delta, low, high = paired_mean_delta(right[1], right[0], rag.bootstrap, rag.seed)
        out[corpus] = {
            "thresholds": own,
            "accuracy": a["accuracy"],
            "variant_accuracy": b["accuracy"],
            "delta": delta,
            "ci_low": low,
            "ci_high": high,
            "retrievals_per_question": a["retrievals_per_question"],
            "variant_retrievals_per_question": b["retrievals_per_question"],
            "became_right": int(sum(y > x for x, y in zip(*right))),
            "became_wrong": int(sum(y < x for x, y in zip(*right))),
        }
        print(
            f"{variant.configuration} · {corpus}: {a['accuracy']:.3f} → {b['accuracy']:.3f} "
            f"({delta:+.3f} [{low:+.3f}, {high:+.3f}]), "
            f"retrievals {a['retrievals_per_question']:.2f} → {b['retrievals_per_question']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return out


def run_score(runtime: VariantRuntime, variant: Score, rag, questions, refs) -> dict[str, Any]:
    """The sweep of the configured trigger and its variant on the sweep corpus: each one's curve area, and the paired
    interval of the difference."""
    from detectors.evaluation.rag_sweep import area_interval, curve, outcome_from_json

    corpus = rag.sweep.corpus
    runtime.variants = {variant.trigger: variant.change}
    configured = runtime.params  # the sweep sweeps the triggers of every configuration: here the two alone
    specs = [variant.trigger, f"{variant.trigger}#variant"]
    runtime.params = dataclasses.replace(
        configured,
        configurations={"variant": dataclasses.replace(next(iter(configured.configurations.values())), triggers=specs)},
    )
    try:
        sweep = runtime.sweep("sweep", corpus, dict(zip(questions, refs)))
        lines = sweep.answer(questions, [False] * len(questions))
        kinds = sweep.key["triggers"]
    finally:
        runtime.params, runtime.variants = configured, {}
        runtime.forget_shared()
    names = list(kinds)
    outcomes = {t: [outcome_from_json(line, t) for line in lines] for t in names}
    before, after = (curve(t, outcomes[t]) for t in names)
    low, high = area_interval(names[1], outcomes[names[1]], rag.bootstrap, rag.seed, reference=outcomes[names[0]])
    out = {
        "corpus": corpus,
        "trigger": names[0],
        "area": before.area,
        "variant_area": after.area,
        "delta": after.area - before.area,
        "ci_low": low,
        "ci_high": high,
        "random_area": before.random_area,
        "rate_to_always": before.rate_to_always,
        "variant_rate_to_always": after.rate_to_always,
    }
    print(
        f"{names[0]} · {corpus}: curve area {before.area:.3f} → {after.area:.3f} "
        f"({out['delta']:+.3f} [{low:+.3f}, {high:+.3f}]; "
        f"random {before.random_area:.3f})",
        file=sys.stderr,
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> None:
    variants = {**PROCEDURES, **SCORES}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    parser.add_argument(
        "--questions", type=int, default=None, help="the first N of the validation questions (default: all)"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/adaptations_cpu.json"))
    args = parser.parse_args(argv)

    import pandas as pd

    from detectors.config import StageParams
    from detectors.rag.experiment import split_questions

    p = StageParams.of("rag_eval", args.params)
    rag = p["rag_eval"]
    metrics = Path(p["paths.rag_metrics"])
    if not metrics.exists():
        raise SystemExit(
            f"{metrics} is missing: run `dvc repro rag_eval` first (the variants run at the thresholds it chose)"
        )
    thresholds = json.loads(metrics.read_text())["thresholds"]
    rows = split_questions(pd.read_parquet(p["paths.qa"]), "val")
    rows = rows.head(args.questions) if args.questions else rows
    questions, refs = list(rows["question"]), [list(a) for a in rows["answers"]]
    runtime = VariantRuntime(p)
    out_path = Path(args.out)
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    out.update({"llm": runtime.llm.fingerprint.name, "dtype": runtime.llm.dtype_name, "questions": len(questions)})
    out.setdefault("variants", {})
    for name in args.variants:
        variant = variants[name]
        if isinstance(variant, Procedure):
            result = {
                "kind": "procedure",
                "configuration": variant.configuration,
                "what": variant.what,
                "corpora": run_procedure(runtime, variant, rag, thresholds, questions, refs),
            }
        else:
            result = {"kind": "score", "what": variant.what, **run_score(runtime, variant, rag, questions, refs)}
        out["variants"][name] = result
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1) + "\n")  # after each variant: a crash keeps the ones done


if __name__ == "__main__":
    main()
