"""The RAG loop's decoder: the shared batched decoder (:mod:`detectors.llm.decoder`) with the loop's rows (a question,
its retrievals, what the controllers note of it), CtrlA's steering on every pass, segments that end at sentence ends,
and the view of a segment that triggers and queries score.

**Prompts.** The rows that need a prompt run it on the longest prefix already run (their own earlier prompt when a
retrieval returned the same first passages; a sequence another configuration ran, from the shared
:class:`~detectors.llm.states.StateCache`; a prompt several rows continue; the few-shot primer, cached once and kept
between batches), in left-padded batches of similar length.

**Segments.** Every row generates its next segment in lockstep, one batched pass per token, each row leaving the batch
at its own stop: a sentence end (unless the row's answer is one segment), a stop string, end of sequence or the token
budget. Decoding is greedy, as the early set's answers are, and every token that ends a segment runs (its probe values
are scored; a row continues from its states).

The decoder knows nothing of triggers or retrieval: :class:`~detectors.rag.loop.RagLoop` decides what a row's prompt
is and what happens to its segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import numpy as np
import torch

from detectors.llm import decoder
from detectors.llm.loading import LLM
from detectors.llm.states import StateCache
from detectors.rag.results import Retrieval
from detectors.rag.stats import Calculator, SegmentView

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclasses.dataclass
class Row(decoder.Row):
    """One question's state: what the decoder runs (:class:`detectors.llm.decoder.Row`) and what the loop and the
    controllers record of it."""

    question: str
    record: bool = False  # keep every prompt the LLM continued
    query: str | None = None  # retrieve with this query before generating (the sweep); None: question triggers decide
    whole: bool = False  # the answer is one segment (no cut at sentence ends)
    retrievals: list[Retrieval] = dataclasses.field(default_factory=list)
    question_stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    question_scores: dict[str, float] = dataclasses.field(default_factory=dict)
    prompts: list[str] = dataclasses.field(default_factory=list)
    finished: bool = False
    error: str | None = None
    seconds: float = 0.0  # measurements reused from another configuration
    segments: list[SegmentView] = dataclasses.field(default_factory=list)  # kept when tracing
    # the trigger whose controller sees what comes next: the first pass of the prompt it retrieved for (``judge``), or
    # the segment re-predicted after its retrieval (``accepting``: kept unscored unless the controller says otherwise)
    judge: Any = None
    accepting: Any = None
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)  # a controller's own state of the row, by its name


class Decoder(decoder.Decoder):
    """Runs rows' prompts and generates their segments with ``llm``, under ``steering`` (CtrlA's honesty vectors,
    active for every pass) and with ``probes`` ({key: probe}) attached; ``shared`` (or None) is the cache of sequences
    other loops over the same LLM and steering ran."""

    def __init__(
        self,
        llm: LLM,
        probes: dict[str, Any],
        steering: dict[int, torch.Tensor],
        shared: StateCache | None,
        batch_size: int,
        stop: tuple[str, ...],
        max_new_tokens: int,
    ):
        self.steering = steering
        super().__init__(
            llm, max_new_tokens, stop, probes, hooks=self._steer, shared=shared, batch_size=batch_size, keep_states=True
        )

    @contextlib.contextmanager
    def _steer(self):
        """Steering on the LLM for one of the loop's own passes (never on a trigger's passes)."""
        from detectors.ctrla.steering import steer

        with steer(self.llm.model, self.steering):
            yield

    def ends_segment(self, row: Row) -> bool:
        """A segment ends at a sentence end, unless the row's answer is one segment."""
        last = self.llm.tokenizer.decode(row.gen[-1:], skip_special_tokens=True).rstrip()
        return not row.whole and bool(_SENTENCE_END.search(last))

    def view(self, row: Row, lazy: dict[str, Calculator]) -> SegmentView:
        """The segment just generated, as triggers and queries see it: its tokens, their ``prob`` and ``entropy``,
        the probes' values over context + segment; ``lazy`` names who computes a statistic on demand."""
        context = row.prompt + row.kept
        n = len(context) + len(row.gen)
        probes = {key: torch.cat(chunks)[:n] for key, chunks in row.values.items()}
        stats = {"prob": np.array(row.prob, np.float64), "entropy": np.array(row.entropy, np.float64)}
        text = self.llm.tokenizer.decode(row.gen, skip_special_tokens=True)
        return SegmentView(
            row.question, context, list(row.gen), text, stats, probes, row.question_stats, lazy, row.kv, len(row.prompt)
        )
