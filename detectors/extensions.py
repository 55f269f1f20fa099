"""The names a RAG configuration (``rag_eval``) is written with, each mapped once to what builds it: the training-free
triggers, the trigger kinds of registered detectors, the query formulations and the frameworks with a loop of their
own (lazy registries, :mod:`detectors.lazy`). A new trigger family, formulation or framework is one entry here beside
its code. Below every package (it imports none: its entries are names), so that ``detectors.config`` reads it.

The module holds names only (and :func:`make_query`, the lookup of a formulation), so that validating ``params.yaml``
(:mod:`detectors.config.rag`) reads them without importing the implementations: the stages that validate the
``rag_eval`` section without running a loop do not depend on the loop's code (``pipelines._provenance.stage_closure``
reads this module's entries as names there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from detectors.lazy import LazyRegistry

# name -> its TriggerEntry (detectors.rag.triggers: builder, own settings' type, offline scorer); the ones with a
# threshold take it from rag_eval.thresholds, their settings from rag_eval.settings.<name>
TRAINING_FREE = LazyRegistry(
    "training-free trigger",
    {
        "always": "detectors.rag.families.always:ALWAYS",
        "flare": "detectors.rag.families.flare:FLARE",
        "rind": "detectors.rag.families.rind:RIND",
        "sit_min": "detectors.rag.families.sit:SIT_MIN",
        "sit": "detectors.rag.families.sit:SIT",
        "entropy_mean": "detectors.rag.families.entropy:ENTROPY_MEAN",
        "entropy_max": "detectors.rag.families.entropy:ENTROPY_MAX",
    },
)
# registered detector kind -> its TriggerEntry (built with the detector attached to the loop's LLM in its context;
# its settings from rag_eval.settings.<kind>)
DETECTOR_KINDS = LazyRegistry(
    "trigger kind of a registered detector",
    {
        "dior-early": "detectors.rag.families.dior:EARLY",
        "dior-realtime": "detectors.rag.families.dior:REALTIME",
        "ctrla-confidence": "detectors.rag.families.ctrla:CTRLA",
        "utility": "detectors.rag.families.utility:UTILITY",
    },
)
# query formulation -> builder(rag_eval.query section, the configuration's triggers, idf) (make_query)
QUERIES = LazyRegistry(
    "query formulation",
    {
        "question": "detectors.rag.queries:build_question",
        "flare": "detectors.rag.queries:build_flare",
        "qfs": "detectors.rag.queries:build_qfs",
        "dior": "detectors.rag.queries:build_dior",
        "ctrla": "detectors.rag.queries:build_ctrla",
    },
)

# seed system with a loop of its own (``rag_eval.frameworks``; its params are the params.yaml section of its name) ->
# its class, built as ``Class(llm, retriever, params, prompt, batch_size)`` with ``answer_all(questions, records)``
FRAMEWORKS = LazyRegistry("framework", {"retrorag": "detectors.rag.retroactive:RetroRag"})


def make_query(name: str, params: Any, triggers: Sequence[Any] = (), idf: Callable[[str], float] | None = None) -> Any:
    """The formulation ``name`` of :data:`QUERIES` (:mod:`detectors.rag.queries`) with its settings: ``params`` is the
    ``rag_eval.query`` section (:class:`~detectors.config.rag.RagQueryParams`), ``triggers`` the configuration's (the
    formulation reads what it needs of them: FLARE's query its trigger's threshold), ``idf`` the retriever's (None
    without a retriever). An
    unknown name is an InputError listing the known ones. Here, not beside the formulations: the registry names them,
    so they cannot import it back."""
    return QUERIES.load(name)(params, triggers, idf)
