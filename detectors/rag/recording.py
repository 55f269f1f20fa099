"""The loop that labels retrieval utility (:func:`~detectors.utility.labels.utility_records` reads it). It is RAG
code above :mod:`detectors.utility`: the RAG loop imports the utility trigger's gate, so ``utility`` must not import
``rag``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from detectors.extensions import FIRES_ALWAYS
from detectors.rag.controllers.gate import Gated
from detectors.rag.families import make_trigger
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.retriever import Retriever
from detectors.utility.labels import RecordingGate


def recording_loop(
    llm, retriever: Retriever, config: RagConfig, layers: Sequence[int]
) -> tuple[RagLoop, RecordingGate]:
    """The loop that labels (:func:`~detectors.utility.labels.utility_records`): ``config``'s RAG loop over
    ``retriever`` with one ``always``
    trigger (one retrieval with the question, before the answer) whose gate records what it saw at the hidden-state
    indices ``layers`` and keeps every retrieval; and that gate."""
    gate = RecordingGate(llm, layers)
    always = dataclasses.replace(make_trigger(FIRES_ALWAYS, llm, {}, ""), controller=Gated(gate))
    return RagLoop(llm, retriever, config, [always]), gate
