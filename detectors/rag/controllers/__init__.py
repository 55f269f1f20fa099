"""Controllers: what a trigger's firing does, beyond the decoder.

The loop (:class:`~detectors.rag.loop.Loop`) decodes, scores each segment with the triggers and hands every
decision to the firing trigger's controller, at three points:

- :meth:`Controller.fired`: the trigger fired (before the question, or on a segment at ``position``): the plain
  controller formulates the loop's query, cuts the segment by the trigger's policy and retrieves; Stitch-in-Time's
  validates the flagged concepts first (:mod:`.validation`);
- :meth:`Controller.prompt_ran`: the prompt with the passages it retrieved has run, before any answer token
  (the utility trigger's gate judges the passages there: :mod:`.gate`);
- :meth:`Controller.repredicted`: the segment generated again after its retrieval (policy ``after_retrieval="accept"``)
  has ended: the plain controller keeps it (and drops the passages for the next segment when the policy's
  ``passages="segment"``); CtrlA's refusal handling retrieves again while it refuses (:mod:`.refusal`).

A controller acts through the loop's own operations (``retrieve``, ``set_prompt``, ``keep``) and charges its batched
LLM calls to their rows with :func:`detectors.rag.results.charge`, so a new procedure is a controller module and a
trigger that names it: no engine file changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from detectors.rag.decoder import Row
from detectors.rag.queries import QueryInput
from detectors.rag.stats import SegmentView


class Loop(Protocol):
    """What a controller may use of the loop (:class:`~detectors.rag.loop.Loop`)."""

    llm: Any
    retriever: Any
    config: Any  # RagConfig: k, max_retrievals, ...
    query: Any  # the configuration's query formulation

    def retrieve(self, rows: list[Row], queries: list[str], triggers: str | list[str], scores: list[float]) -> None:
        """One retrieval per row with its query, recorded under its trigger's name; the passages go in its prompt."""

    def set_prompt(self, row: Row, hits: list | None, query: str, context: str | None = None) -> None:
        """The row's prompt with ``hits`` before the question (none: without passages); it runs again."""

    def keep(self, row: Row, view: SegmentView) -> None:
        """The segment stays in the answer."""


@dataclasses.dataclass
class Fire:
    """A trigger that fired on a row: at token ``position`` of ``view`` (None and 0 before the question), with
    ``score``."""

    row: Row
    trigger: Any  # detectors.rag.triggers.Trigger
    view: SegmentView | None
    position: int
    score: float


class Controller:
    """Retrieve with the loop's query where the trigger fires, and keep what is generated after (see the module's
    docstring). Subclasses change one step (the settings they read are their trigger's, in a run's key)."""

    def parts(self) -> list[Any]:
        """What it runs beside itself (whose modules are the run's code)."""
        return []

    def probes(self) -> dict[str, Any]:
        """Probes it needs on the loop's passes ({key: probe}): their values are in ``row.values[key]``."""
        return {}

    def fired(self, loop: Loop, fires: list[Fire]) -> None:
        inputs = [QueryInput(f.row.question, f.row.kept, f.view, f.position, f.row.question_stats) for f in fires]
        queries = loop.query.formulate_all(loop.llm, inputs)
        for f in fires:
            if f.view is not None:
                f.row.kept += f.row.gen[: f.trigger.cut_at(f.position)]
                f.row.gen = []
        loop.retrieve([f.row for f in fires], queries, [f.trigger.name for f in fires], [f.score for f in fires])
        for f in fires:
            self.after_retrieval(f)

    def after_retrieval(self, fire: Fire) -> None:
        """Who sees what comes after the retrieval: the segment re-predicted, when the trigger's policy accepts it."""
        if fire.view is not None and fire.trigger.policy.after_retrieval == "accept":
            fire.row.accepting = fire.trigger

    def prompt_ran(self, loop: Loop, rows: list[Row]) -> list[Row]:
        """Rows whose retrieved prompt just ran (``row.judge`` was this controller's trigger); returns the rows whose
        prompt changed and must run again."""
        return []

    def repredicted(self, loop: Loop, items: list[tuple[Row, SegmentView, Any]]) -> None:
        """Segments re-predicted after the trigger's retrieval (``(row, view, trigger)``): kept; the next segment is
        predicted without the passages when the policy's ``passages="segment"`` (CtrlA's Alg. 1, line 4)."""
        for row, view, trigger in items:
            loop.keep(row, view)
            if trigger.policy.passages == "segment" and not row.finished:
                loop.set_prompt(row, None, row.question)


RETRIEVE = Controller()  # the plain controller: one instance, so the triggers it serves batch together
