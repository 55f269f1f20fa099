"""What the rag_eval stage runs to answer its questions: the LLM, the corpora's retrievers, the triggers, one RAG loop
per configuration (or a framework's own loop), each wrapped as ``answer(questions, record_prompts) -> [dict]``
(JSON-able RagResults, one per question), and the resumable runs that store the answers (:func:`run_questions`,
:class:`RunWorker`). The runs are keyed on this module's import closure: the code that answers, not the stage's
reporting."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from detectors.config.rag import on_corpus, trigger_names
from detectors.errors import InputError
from detectors.execution import LLMSpec
from detectors.inference import load_detector
from detectors.rag.loop import RagConfig, RagLoop, RagResult
from detectors.rag.answer_metrics import FAILED
from detectors.rag.queries import DiorWeights, make_query
from detectors.rag.retriever import BM25Retriever
from detectors.rag.sweep import sweep_line, trace_events
from detectors.rag.triggers import TriggerSettings, check_threshold, make_trigger
from detectors.progress import progress
from detectors.registry import store
from detectors.shards import ERROR, OK, ShardStore

log = logging.getLogger("rag_eval")

Answer = Callable[[list[str], list[bool]], list[dict]]
SWEEP = "sweep"  # the test sweep's run, and the metrics file's key for the curves
VAL_SWEEP = "sweep-val"  # each corpus's sweep of the validation questions, where every operating threshold is chosen


def resilient(name: str, answer_all: Callable[[list[str], list[bool]], list[RagResult]]) -> Answer:
    """``answer_all`` as JSON-able dicts; when a batch raises, its questions are answered one by one, so that only the
    question that raises is recorded as failed (``failed: <error>``) and the others are answered."""

    def answer(questions: list[str], records: list[bool]) -> list[dict]:
        try:
            return [dataclasses.asdict(r) for r in answer_all(questions, records)]
        except Exception:  # noqa: BLE001 - retried one by one below, where a question's own failure is recorded
            if len(questions) == 1:
                raise
            log.warning("%s: a batch of %d questions raised; answering them one by one", name, len(questions))
        out = []
        for question, record in zip(questions, records):
            try:
                out.append(dataclasses.asdict(answer_all([question], [record])[0]))
            except Exception as err:  # recorded, never a crash halfway; the stage stops if most questions fail
                log.exception("%s: %r failed", name, question)
                out.append(dataclasses.asdict(RagResult(question, "", [], 0, 0, 0.0, [], f"{FAILED} {type(err).__name__}: {err}")))
        return out

    return answer


class RagRuntime:
    """The stage's LLM, retrievers (loaded once per corpus) and triggers (loaded once per name)."""

    def __init__(self, params):
        self.stage_params, self.params = params, params["rag_eval"]
        self.llm = LLMSpec.of(params).load()
        self.llm_name, self.llm_digest = self.llm.fingerprint.name, store.llm_digest(self.llm.fingerprint)
        self.tracking_uri = store.configure(params["mlflow"].tracking_uri)
        self._retrievers: dict[str, BM25Retriever] = {}
        self._triggers: dict[str, Any] = {}

    def retriever(self, corpus: str) -> BM25Retriever:
        if corpus not in self._retrievers:
            self._retrievers[corpus] = BM25Retriever.load(Path(self.stage_params["paths.rag_index"]) / corpus)
        return self._retrievers[corpus]

    def corpus_digest(self, corpus: str) -> str:
        return self.retriever(corpus).digest

    def trigger(self, spec: str, corpus: str, thresholds: dict[str, float] | None = None):
        """Trigger ``spec`` for ``corpus`` (``{corpus}`` in a spec names the corpus: a utility trigger is trained per
        corpus) at its threshold in ``thresholds`` (by trigger name; None: a sweep, where no threshold is read)."""
        spec = on_corpus(spec, corpus)
        if spec not in self._triggers:  # built once, without a threshold: each loop sets its triggers' thresholds below
            settings = TriggerSettings(sit=self.params.sit, ctrla=self.params.ctrla)
            trigger = make_trigger(spec, self.llm, None, self.stage_params["build_realtime.spacy_model"], self.tracking_uri, settings)
            if trigger.name in self.params.thresholds:
                check_threshold(trigger, self.params.thresholds[trigger.name], f"rag_eval.thresholds.{trigger.name}")
            self._triggers[spec] = trigger
        trigger = self._triggers[spec]
        if thresholds is None or trigger.name == "always":
            return trigger
        if trigger.name not in thresholds:
            raise InputError(f"trigger {trigger.name!r} has no threshold on corpus {corpus!r}: its validation sweep did not measure it")
        return dataclasses.replace(trigger, threshold=thresholds[trigger.name])

    def rag_config(self, name: str, stepwise: bool = False, chunk: bool = False, max_retrievals: int | None = None, context: str | None = None) -> RagConfig:
        r = self.params
        return RagConfig(
            name=name, prompt=self.stage_params["build_early.features.prompt"], context=r.context if context is None else context, k=r.k,
            max_retrievals=r.max_retrievals if max_retrievals is None else max_retrievals, max_new_tokens=r.max_new_tokens,
            stop=tuple(self.stage_params["build_early.stop"]), stepwise=stepwise, chunk=chunk, batch_size=r.batch_size,
        )  # fmt: skip

    def query(self, name: str, triggers: list, retriever: BM25Retriever | None):
        """Formulation ``name``; FLARE's masks words under 1 - the FLARE trigger's threshold (0.5 without one)."""
        q = self.params.query
        theta = next((1 - t.threshold for t in triggers if t.name == "flare"), 0.5)
        weights = DiorWeights(**dataclasses.asdict(q.dior_weights))
        return make_query(name, theta, q.qfs_top_n, weights, q.dior_top, retriever.idf if retriever else None)

    def loop(self, name: str, config, corpus: str, thresholds: dict[str, float]) -> Answer:
        """Configuration ``name`` (a ``rag_eval.configurations`` entry) over ``corpus``, its triggers at ``thresholds``,
        as ``answer(questions, records)``."""
        triggers = [self.trigger(t, corpus, thresholds) for t in config.triggers]
        steering = None
        if config.steering:
            steer_name, alias = config.steering.split("@", 1)
            steering = load_detector(steer_name, alias=alias, llm=self.llm, tracking_uri=self.tracking_uri).vectors()
        retriever = self.retriever(corpus) if triggers else None
        rag = RagLoop(self.llm, retriever, self.rag_config(name, config.stepwise, config.chunk, context=config.context), triggers,
                      self.query(config.query, triggers, retriever), steering)  # fmt: skip
        return resilient(name, rag.answer_all)

    def framework(self, name: str, corpus: str) -> Answer:
        """Seed system ``name`` of ``rag_eval.frameworks`` (its own loop, its params the section of its name) over
        ``corpus``, as ``answer(questions, records)``."""
        from detectors.rag.retroactive import RetroRag  # the only framework (FRAMEWORKS)

        rag = RetroRag(self.llm, self.retriever(corpus), self.stage_params[name], self.stage_params["build_early.features.prompt"], self.params.batch_size)
        return resilient(name, rag.answer_all)

    def sweep_loop(self, corpus: str) -> tuple[Callable[[list[str], list[list[str]]], list[dict]], dict[str, str]]:
        """The sweep over ``corpus``: ``sweep(questions, references)`` (the stored lines) and the swept triggers' kinds by
        name (``baseline``: training-free; ``detector``: trained), every trigger of the configurations but ``always``,
        which is the sweep's position-0 reference."""
        specs = list(dict.fromkeys(t for c in self.params.configurations.values() for t in c.triggers if t != "always"))
        triggers = [self.trigger(t, corpus) for t in specs]
        retriever = self.retriever(corpus)
        rag = RagLoop(self.llm, retriever, self.rag_config("sweep", max_retrievals=1), triggers)  # the query is the job's (the question)

        def sweep(questions: list[str], references: list[list[str]]) -> list[dict]:
            traces = rag.trace(questions)
            events = [trace_events(t) for t in traces]
            positions = [sorted({0} | {p for e in ev.values() for _, p in e}) for ev in events]
            jobs = [(t.question, t.gen_ids, p, t.question) for t, ps in zip(traces, positions) for p in ps]
            after = iter(rag.answer_after(jobs))
            lines = []
            for trace, ev, ps, refs in zip(traces, events, positions, references):
                results = {p: next(after) for p in ps}
                line = sweep_line(ev, trace.answer, {p: r.answer for p, r in results.items()}, refs)
                line["forward_passes"] = trace.forward_passes + sum(r.forward_passes for r in results.values())
                line["errors"] = {str(p): r.error for p, r in results.items() if r.error}
                lines.append(line)
            return lines

        return sweep, {t.name: t.scorer.kind for t in triggers}


# ---- resumable runs ------------------------------------------------------------------------------------------


def run_questions(directory: Path, key: dict[str, Any], rows: pd.DataFrame, answer: Callable[[list[str], list[bool]], list[dict]],
                  prompts_sample: int, desc: str, shard_size: int) -> list[dict]:  # fmt: skip
    """Answer every row (``id``, ``question``) with ``answer(questions, record_prompts)`` (JSON-able dicts,
    ``dataclasses.asdict`` of RagResults), in resumable shards of ``shard_size`` questions under ``directory`` (a
    :class:`~detectors.shards.ShardStore` keyed on ``key``: what shapes the answers; another key starts it again).
    Each question is a row ``id``, ``status`` (``error: …`` for a question whose loop raised, computed again by the
    next run) and ``line`` (its result as JSON); the first ``prompts_sample`` rows record their prompts. Returns the
    lines of every row, in the rows' order."""
    ids = hashlib.sha256("\x1f".join(rows["id"]).encode()).hexdigest()[:16]  # the shards cover exactly these questions
    store = ShardStore(directory, {**key, "questions_digest": ids, "shard_size": shard_size})
    table = rows[["id", "question"]].reset_index(drop=True)
    todo = store.todo(table, shard_size)
    left = sum(len(chunk) for _, chunk in todo)
    with progress(total=len(table), initial=len(table) - left, desc=desc, unit="question") as bar:
        for k, chunk in todo:
            results = answer(list(chunk["question"]), [i < prompts_sample for i in chunk.index])
            status = [f"{ERROR}{r['error']}" if str(r.get("error") or "").startswith(FAILED) else OK for r in results]
            store.write(k, pd.DataFrame({"id": list(chunk["id"]), "status": status, "line": [json.dumps(r) for r in results]}))
            bar.update(len(chunk))
    frame = store.read_all(len(table), shard_size)
    return [{"id": i, **json.loads(line)} for i, line in zip(frame["id"], frame["line"])]


class RunWorker:
    """Answers the questions of one run per call (a corpus × configuration at its corpus's ``thresholds``, a framework,
    or a sweep: of the test questions, or of the validation ones), resuming it; builds the LLM, retrievers and triggers
    once (in the stage's process or a Ray actor). Returns the run's lines and the digests that identify what answered
    them."""

    def __init__(self, params, rows: dict[str, pd.DataFrame], base_key: dict[str, Any], thresholds: dict[str, dict[str, float]] | None = None):
        self.runtime, self.rag, self.rows, self.base_key, self.thresholds = RagRuntime(params), params["rag_eval"], rows, base_key, thresholds
        self.runs_dir = Path(params["paths.rag_runs"])

    def __call__(self, unit: tuple[str, str]) -> dict[str, Any]:
        corpus, name = unit
        runtime, rag = self.runtime, self.rag
        base = {**self.base_key, "llm": runtime.llm_digest, "corpus": runtime.corpus_digest(corpus)}
        out: dict[str, Any] = {"llm": [runtime.llm_name, runtime.llm_digest], "corpus_digest": base["corpus"]}
        directory, desc, rows = self.runs_dir / corpus / name, f"{corpus} · {name}", self.rows["test"]
        if name in (SWEEP, VAL_SWEEP):
            rows = self.rows["val" if name == VAL_SWEEP else "test"]
            sweep_loop, out["triggers"] = runtime.sweep_loop(corpus)
            key = {**base, "sweep": dataclasses.asdict(rag.sweep), "triggers": out["triggers"], "questions": name}
            refs = {q: list(a) for q, a in zip(rows["question"], rows["answers"])}
            answer, sample = (lambda qs, _: sweep_loop(qs, [refs[q] for q in qs])), 0
        elif name in rag.frameworks:  # a seed system with its own loop; its params are the section of its name
            key = {**base, "framework": name, "params": dataclasses.asdict(runtime.stage_params[name])}
            answer, sample = runtime.framework(name, corpus), rag.prompts_sample
        else:
            config = rag.configurations[name]
            names = {n for s in config.triggers for n in trigger_names(s, [corpus])}
            thresholds = {t: v for t, v in self.thresholds[corpus].items() if t in names}
            key = {**base, "configuration": dataclasses.asdict(config), "thresholds": thresholds}
            answer, sample = runtime.loop(name, config, corpus, self.thresholds[corpus]), rag.prompts_sample
        out["lines"] = run_questions(directory, key, rows, answer, sample, desc, rag.shard_size)
        return out
