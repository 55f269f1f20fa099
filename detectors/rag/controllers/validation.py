"""Stitch-in-Time's validation and repair ("A Stitch in Time Saves Nine", arXiv 2307.03987, §2.1.3-2.2) as a
controller: a segment its trigger flagged is not retrieved for; each uncertain concept is validated instead, and the
segment is repaired only when one fails."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from detectors.rag.context import render_passages
from detectors.rag.controllers import Controller, Fire, Loop
from detectors.rag.results import Retrieval, charge


@dataclasses.dataclass(frozen=True)
class ValidateAndRepair(Controller):
    """The rows whose trigger fired have their uncertain concepts (each concept scored at or above the threshold, most
    uncertain first; the concepts are the scorer's ``spans`` statistic) validated one after another, within
    ``max_retrievals``: the concept's validation question is the query, and ``validator``
    (:class:`~detectors.baselines.stitch_in_time.SitValidator`) answers it from the passages. The first concept that
    fails repairs the segment: it is generated again with those passages in the prompt and kept (the trigger's policy
    accepts it). A segment whose every concept passes stays as it was, and the passages are not used (recorded with
    ``used=False`` and the validator's P(yes))."""

    validator: Any

    def parts(self) -> list[Any]:
        return [self.validator]

    def fired(self, loop: Loop, fires: list[Fire]) -> None:
        tok, v = loop.llm.tokenizer, self.validator
        queue = []
        for f in fires:
            scores = f.trigger.token_scores(f.view.stats)
            spans = {int(idx[0]): idx for idx in f.view.stats[f.trigger.scorer.spans] if len(idx)}
            order = [
                i for i in np.argsort(-scores, kind="stable") if scores[i] >= f.trigger.threshold and int(i) in spans
            ]
            room = loop.config.max_retrievals - len(f.row.retrievals)
            concepts = [
                (float(scores[i]), tok.decode([f.view.gen_ids[j] for j in spans[int(i)]], skip_special_tokens=True))
                for i in order
            ][:room]
            if concepts:
                queue.append((f, concepts))
        while queue:
            jobs = [(f, concepts.pop(0)) for f, concepts in queue]
            questions = [v.question(f.row.question, f.view.text, concept) for f, (_, concept) in jobs]
            found = loop.retriever.batch_search(questions, loop.config.k)
            passages = [render_passages(hits, False, q) for hits, q in zip(found, questions)]
            verdict = v.judge(questions, passages, on_batch=charge([f.row for f, _ in jobs]))
            for (f, (score, _)), question, hits, p_yes in zip(jobs, questions, found, verdict):
                row = f.row
                retrieval = Retrieval.of(f.trigger.name, len(row.kept), score, [question], hits, used=False)
                retrieval.gate_score = float(p_yes)
                row.retrievals.append(retrieval)
                if p_yes < v.threshold:  # a hallucinated concept: repair the sentence with the evidence
                    retrieval.used = True
                    row.gen = []
                    self.repair(loop, f, hits, question)
            queue = [(f, c) for f, c in queue if f.row.gen and c]
        for f in fires:
            if f.row.gen:  # every concept passed: the segment stays
                loop.keep(f.row, f.view)

    def repair(self, loop: Loop, fire: Fire, hits: list, query: str) -> None:
        """The segment is generated again with the passages ``hits`` of the failed concept's validation question
        ``query`` in the prompt (§2.2), and kept (the trigger's policy accepts it)."""
        loop.set_prompt(fire.row, hits, query)
        self.after_retrieval(fire)
