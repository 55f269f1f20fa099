"""The retrieval triggers, one module per family: its trigger entries (:class:`~detectors.rag.triggers.TriggerEntry`,
named in :data:`detectors.extensions.TRAINING_FREE` and :data:`~detectors.extensions.DETECTOR_TRIGGERS`) and the
calculators of the statistics it reads. A configuration of the loop depends on the modules of its own triggers only, so
changing one family's code reruns only the configurations that use it (rag_eval's runs are keyed on their code).
:func:`make_trigger` and :func:`make_query` build a configuration's triggers and its query formulation by name, each
with its entry's own settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from detectors.config.core import entry_settings
from detectors.errors import InputError
from detectors.extensions import DETECTOR_KINDS, DETECTOR_TRIGGERS, QUERIES, TRAINING_FREE, thresholded
from detectors.rag.triggers import Trigger, TriggerContext, TriggerEntry

if TYPE_CHECKING:
    from detectors.interfaces import Level
    from detectors.llm.loading import LLM


SETTINGS = "rag_eval.settings"  # the trigger entries' own settings, by entry name
QUERY_SETTINGS = "rag_eval.query_settings"  # the query formulations', by name


def make_trigger(
    spec: str,
    llm: LLM,
    thresholds: dict[str, float] | None = None,
    spacy_model: str = "",
    tracking_uri: str | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Trigger:
    """The trigger named ``spec``: one of :data:`TRAINING_FREE` (its threshold from ``thresholds``; None: +inf, to be
    set later, as a sweep does) or ``<registered model>@<alias>`` loaded with :func:`detectors.load_detector` (from
    ``tracking_uri``) onto ``llm``, with the trigger its class names (``TRIGGER``) built around it; a detector built
    with another LLM is refused by its fingerprint. ``settings``: ``rag_eval.settings``, each entry's own params by its
    name (:func:`~detectors.config.core.entry_settings`); ``spacy_model``: the pipeline of the triggers that find
    entities."""
    if "@" not in spec:  # a training-free trigger
        entry: TriggerEntry = TRAINING_FREE.load(spec)  # an unknown name: an InputError listing the known ones
        if thresholds is not None and thresholded(spec) and spec not in thresholds:
            raise InputError(
                f"trigger {spec!r} has no threshold: give rag_eval.thresholds.{spec} (a number or `validation`)"
            )
        own = entry_settings(entry.settings, spec, settings, SETTINGS, "trigger")
        trigger = entry.build(TriggerContext(llm, spacy_model), own)
        if thresholds is not None and spec in thresholds:
            trigger = dataclasses.replace(trigger, threshold=thresholds[spec])
        return dataclasses.replace(trigger, source=TRAINING_FREE.module(spec), entry=spec, settings=own)
    name, alias = spec.split("@", 1)
    from detectors.inference import load_detector

    # not registered: NotRegisteredError, an InputError
    detector = load_detector(name, alias=alias, llm=llm, tracking_uri=tracking_uri)
    if detector.TRIGGER is None:
        raise InputError(
            f"trigger {spec!r}: a {detector.KIND!r} detector does not decide retrieval (use a detector of kind "
            f"{', '.join(DETECTOR_KINDS)})"
        )
    entry = DETECTOR_TRIGGERS.load(detector.TRIGGER)
    context = TriggerContext(llm, spacy_model, name, detector, spec)
    own = entry_settings(entry.settings, detector.KIND, settings, SETTINGS, "trigger")
    trigger = entry.build(context, own)
    module = DETECTOR_TRIGGERS.module(detector.TRIGGER)
    return dataclasses.replace(trigger, source=module, detector=detector, entry=detector.KIND, settings=own)


def trigger_scorers(level: Level, stats: set[str], listed: list) -> list:
    """The training-free triggers' offline scorers (their entries' ``offline``) defined at ``level`` whose per-token
    statistic is among ``stats``, one per class not already among ``listed`` (the catalog's baselines): with them the
    comparison scores every trigger offline, a new trigger's score included, with no second registry entry."""
    classes, out = {type(s) for s in listed}, []
    for name in TRAINING_FREE:
        cls = TRAINING_FREE.load(name).offline
        if cls is None or cls in classes or level not in cls.levels or cls.stat not in stats:
            continue
        classes.add(cls)
        out.append(cls(level))
    return out


def make_query(
    name: str,
    settings: Mapping[str, Any] | None = None,
    triggers: Sequence[Trigger] = (),
    idf: Callable[[str], float] | None = None,
) -> Any:
    """The formulation ``name`` of :data:`~detectors.extensions.QUERIES` (:mod:`detectors.rag.queries`) built by its
    entry from its own settings (``settings``: ``rag_eval.query_settings``, each formulation's params by its name),
    the configuration's ``triggers`` (it reads what it needs of them: FLARE's query its trigger's threshold) and the
    retriever's ``idf`` (None without a retriever). An unknown name is an InputError listing the known ones."""
    entry = QUERIES.load(name)
    return entry.build(
        entry_settings(entry.settings, name, settings, QUERY_SETTINGS, "query formulation"), triggers, idf
    )
