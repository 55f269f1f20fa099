"""The names a RAG configuration (``rag_eval``) is written with, each mapped once to what builds it: the training-free
triggers, the triggers built around registered detectors, the query formulations and the frameworks with a loop of
their own (lazy registries, :mod:`detectors.lazy`). A new trigger family, formulation or framework is one entry here
beside its code; a new trained kind is none (its class declares its ``KIND`` and the ``TRIGGER`` it plugs into). Below
every package (it imports none: its entries are names), so that ``detectors.config`` reads it.

The module holds names only, so that validating ``params.yaml``
(:mod:`detectors.config.rag`) reads them without importing the implementations: the stages that validate the
``rag_eval`` section without running a loop do not depend on the loop's code (``pipelines._provenance.stage_closure``
reads this module's entries as names there).
"""

from __future__ import annotations

from detectors.imports import declared_classes
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
# the training-free trigger that retrieves once, with the question, before every answer: the one trigger without a
# threshold, and the trigger of the "always" reference (detectors.config.rag.references)
FIRES_ALWAYS = "always"


def thresholded(spec: str) -> bool:
    """Whether the configured trigger ``spec`` has a threshold to fix or choose (every one but :data:`FIRES_ALWAYS`)."""
    return spec != FIRES_ALWAYS


# the trigger a registered detector's class names (``Detector.TRIGGER``) -> its TriggerEntry, built with the detector
# attached to the loop's LLM in its context: a new kind that decides like one of these (a probability of the question's
# early-set columns, of each generated token's hidden states) names it and needs no entry
DETECTOR_TRIGGERS = LazyRegistry(
    "trigger of a registered detector",
    {
        "early": "detectors.rag.families.dior:EARLY",
        "realtime": "detectors.rag.families.dior:REALTIME",
        "ctrla": "detectors.rag.families.ctrla:CTRLA",
        "utility": "detectors.rag.families.utility:UTILITY",
    },
)
# the trigger kinds: the KIND of every detector class that declares a TRIGGER, read from the sources as names (the
# params' validation reads them; a configuration's <registered model>@<alias> loads its class through the registry),
# each with its settings under rag_eval.settings.<kind>
DETECTOR_KINDS = tuple(declared_classes("KIND", having="TRIGGER"))
# query formulation -> its QueryEntry (detectors.rag.queries: builder and own settings' type, which it takes from
# rag_eval.query_settings.<name>), built by detectors.rag.families.make_query
QUERIES = LazyRegistry(
    "query formulation",
    {
        "question": "detectors.rag.queries:QUESTION",
        "flare": "detectors.rag.queries:FLARE",
        "qfs": "detectors.rag.queries:QFS",
        "dior": "detectors.rag.queries:DIOR",
        "ctrla": "detectors.rag.queries:CTRLA",
    },
)

# seed system with a loop of its own (``rag_eval.frameworks``; its params are the params.yaml section of its name) ->
# its class, built as ``Class(llm, retriever, params, prompt, batch_size)`` with ``answer_all(questions, records)``
FRAMEWORKS = LazyRegistry("framework", {"retrorag": "detectors.rag.retroactive:RetroRag"})
