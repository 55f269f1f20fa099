"""CtrlA's refusal handling H_R ("CtrlA: Adaptive Retrieval-Augmented Generation via Inherent Control", arXiv
2405.18727, App. B.3, Alg. 2-3) as a controller: a segment re-predicted after its trigger's retrieval that still
refuses gets a rewritten query, and is re-predicted again."""

from __future__ import annotations

import dataclasses
from typing import Any

from detectors.rag.controllers import Controller, Loop
from detectors.rag.decoder import Row
from detectors.rag.results import charge
from detectors.rag.stats import SegmentView


@dataclasses.dataclass(frozen=True)
class RefusalRetry(Controller):
    """The plain retrieval; a re-predicted segment that refuses (f_d of ``handler``,
    :class:`~detectors.ctrla.refusal.RefusalHandler`) while attempts (K) and retrievals are left has its previous query
    rewritten (f_QR): the passages it retrieves replace the old ones and the segment is re-predicted. The retrieval is
    recorded as ``<trigger>:refusal`` with score +inf (the refusal detector's)."""

    handler: Any

    def parts(self) -> list[Any]:
        return [self.handler]

    def repredicted(self, loop: Loop, items: list[tuple[Row, SegmentView, Any]]) -> None:
        h = self.handler
        refused, kept = [], []
        for item in items:
            row, view, _ = item
            attempts = row.notes.get("refusal", 0)
            still = h.refuses(view.text) and attempts < h.max_attempts
            (refused if still and len(row.retrievals) < loop.config.max_retrievals else kept).append(item)
        for row, _, _ in kept:
            row.notes.pop("refusal", None)
        super().repredicted(loop, kept)
        if refused:
            rows = [row for row, _, _ in refused]
            previous = [r.retrievals[-1].queries[-1] for r in rows]
            queries = h.rewrite([r.question for r in rows], previous, on_batch=charge(rows))
            for row, _, trigger in refused:
                row.gen, row.notes["refusal"], row.accepting = [], row.notes.get("refusal", 0) + 1, trigger
            names = [f"{trigger.name}:refusal" for _, _, trigger in refused]
            loop.retrieve(rows, queries, names, [float("inf")] * len(rows))
