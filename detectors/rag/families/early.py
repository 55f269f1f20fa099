"""The question features every early trigger reads (DioR's early detector, the utility trigger): the early set's
columns,
measured once per question, LLM and feature params."""

from __future__ import annotations

import dataclasses
import json
import time
import weakref

import torch

from detectors.dior.early import batch_question_features, features_to_row
from detectors.errors import RecordError
from detectors.llm.kv import ForwardCounter
from detectors.llm.loading import LLM
from detectors.rag.stats import Calculator, Measured


class EarlyCalculator(Calculator):
    """The early set's columns of each question (:func:`~detectors.dior.early.batch_question_features`, the
    function build_early and ``assess`` call), ``batch`` questions per call; IG only when the detector reads the
    attribution (its ``attribution`` or ``entropy`` groups). A question is measured once per LLM and feature params and
    reused by every detector and configuration that asks again (the first computation's cost is reported with the
    reuse): the dior-early and utility triggers of every corpus share one measurement."""

    key, question = "early", ("early",)

    def __init__(self, detector, batch: int = 32):
        self.detector, self.batch = detector, batch
        self.attribution = bool({"attribution", "entropy"} & set(detector.groups))

    def _done(self, llm: LLM) -> dict[str, tuple[dict | Exception, int, float, bool]]:
        """The measurements shared by every calculator of ``llm`` with these feature params: question -> (columns or
        error, forward passes, seconds, with attribution)."""
        shared = _MEASURED.setdefault(llm.model, {})
        return shared.setdefault(json.dumps(dataclasses.asdict(self.detector.features), sort_keys=True), {})

    def questions(self, questions: list[str]) -> list[Measured]:
        llm = self.detector.require_llm()
        done = self._done(llm)
        todo = [q for q in dict.fromkeys(questions) if q not in done or (self.attribution and not done[q][3])]
        fresh = set(todo)
        for start in range(0, len(todo), self.batch):
            chunk = todo[start : start + self.batch]
            began = time.perf_counter()
            with ForwardCounter(llm.model) as counter:
                feats = batch_question_features(llm, chunk, self.detector.features, attribution=self.attribution)
            seconds = (time.perf_counter() - began) / len(chunk)
            for q, f in zip(chunk, feats):
                done[q] = (
                    f if isinstance(f, RecordError) else features_to_row(f),
                    counter.calls,
                    seconds,
                    self.attribution,
                )
        return [Measured(*done[q][:3], fresh=q in fresh) for q in questions]


_MEASURED: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()  # EarlyCalculator's, per LLM
