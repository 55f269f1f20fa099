"""What the rag_eval stage runs: the LLM, the corpora's retrievers, the triggers and one RAG loop per configuration,
each wrapped as ``answer(question, record_prompts) -> dict`` (a JSON-able RagResult) for the stage's run files."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

from detectors.execution import LLMSpec
from detectors.inference import load_detector
from detectors.rag.metrics import FAILED
from detectors.rag.loop import RagConfig, RagLoop, RagResult, answer_after, question_trace
from detectors.rag.queries import DiorWeights
from detectors.rag.retriever import BM25Retriever
from detectors.rag.sweep import sweep_line, trace_events
from detectors.rag.triggers import make_trigger
from detectors.registry import store

log = logging.getLogger("rag_eval")


class RagRuntime:
    """The stage's LLM, retrievers (loaded once per corpus) and triggers (loaded once per name)."""

    def __init__(self, p, thresholds: dict[str, float]):
        self.p, self.params, self.thresholds = p, p["rag_eval"], thresholds
        self.llm = LLMSpec.of(p).load()
        self.llm_name, self.llm_digest = self.llm.fingerprint.name, store.llm_digest(self.llm.fingerprint)
        self.tracking_uri = store.configure(p["mlflow"].tracking_uri)
        self._retrievers: dict[str, BM25Retriever] = {}
        self._triggers: dict[str, Any] = {}

    def retriever(self, corpus: str) -> BM25Retriever:
        if corpus not in self._retrievers:
            self._retrievers[corpus] = BM25Retriever.load(Path(self.p["paths.rag_index"]) / corpus)
        return self._retrievers[corpus]

    def corpus_digest(self, corpus: str) -> str:
        return self.retriever(corpus).digest

    def trigger(self, spec: str):
        if spec not in self._triggers:
            self._triggers[spec] = make_trigger(spec, self.llm, self.thresholds, self.p["build_realtime.spacy_model"], self.tracking_uri)
        return self._triggers[spec]

    def rag_config(self, name: str, query: str, stepwise: bool = False, chunk: bool = False, max_retrievals: int | None = None) -> RagConfig:
        r = self.params
        return RagConfig(
            name=name, prompt=self.p["build_early.features.prompt"], context=r.context, k=r.k,
            max_retrievals=r.max_retrievals if max_retrievals is None else max_retrievals, max_new_tokens=r.max_new_tokens,
            stop=tuple(self.p["build_early.stop"]), query=query, stepwise=stepwise, chunk=chunk, qfs_top_n=r.query.qfs_top_n,
            dior_top=r.query.dior_top, dior_weights=DiorWeights(**dataclasses.asdict(r.query.dior_weights)),
        )  # fmt: skip

    def loop(self, name: str, config, corpus: str) -> Callable[[str, bool], dict]:
        """Configuration ``name`` (a ``rag_eval.configurations`` entry) over ``corpus`` as ``answer(question, record)``."""
        triggers = [self.trigger(t) for t in config.triggers]
        steering = None
        if config.steering:
            steer_name, alias = config.steering.split("@", 1)
            steering = load_detector(steer_name, alias=alias, llm=self.llm, tracking_uri=self.tracking_uri).vectors()
        retriever = self.retriever(corpus) if triggers else None
        rag = RagLoop(self.llm, retriever, self.rag_config(name, config.query, config.stepwise, config.chunk), triggers, steering,
                      idf=retriever.idf if retriever else None)  # fmt: skip

        def answer(question: str, record: bool) -> dict:
            rag.record_prompts = record
            try:
                return dataclasses.asdict(rag.answer(question))
            except Exception as err:  # recorded, never a crash halfway; the stage stops if most questions fail
                log.exception("%s: %r failed", name, question)
                return dataclasses.asdict(RagResult(question, "", [], 0, 0, 0.0, [], f"{FAILED} {type(err).__name__}: {err}"))

        return answer

    def sweep_loop(self, corpus: str) -> tuple[Callable[[str, list[str]], dict], list[str]]:
        """The sweep over ``corpus``: ``sweep(question, references)`` (the stored line) and the swept triggers' names
        (every trigger of the configurations but ``always``, which is the sweep's position-0 reference)."""
        specs = list(dict.fromkeys(t for c in self.params.configurations.values() for t in c.triggers if t != "always"))
        triggers = [self.trigger(t) for t in specs]
        retriever = self.retriever(corpus)
        rag = RagLoop(self.llm, retriever, self.rag_config("sweep", self.params.sweep.query, max_retrievals=1), triggers, idf=retriever.idf)

        def sweep(question: str, references: list[str]) -> dict:
            trace = question_trace(rag, question)
            events = trace_events(trace)
            positions = sorted({0} | {p for e in events.values() for _, p in e})
            after = {p: answer_after(rag, question, trace.gen_ids, p, question) for p in positions}
            line = sweep_line(events, trace.answer, {p: r.answer for p, r in after.items()}, references)
            line["forward_passes"] = trace.forward_passes + sum(r.forward_passes for r in after.values())
            line["errors"] = {str(p): r.error for p, r in after.items() if r.error}
            return line

        return sweep, [t.name for t in triggers]
