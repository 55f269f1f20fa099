"""Which type validates each section of ``params.yaml``: one entry per section, ``"module:Class"``, imported
only when the section is read.

The registry is lazy so that a stage's import closure (its code deps in ``dvc.yaml`` and the key of its
resumable shards) holds the modules of the sections it reads and no other: a new ``rag_eval`` key does not
rerun ``build_early``. :func:`section_modules` tells :mod:`pipelines._provenance` which modules those are.
"""

from __future__ import annotations

import importlib
from typing import Iterable

from detectors.config.core import ParamsError

SECTIONS: dict[str, str] = {
    "paths": "detectors.config.common:PathsParams",
    "llm": "detectors.config.common:LLMParams",
    "mlflow": "detectors.config.common:MLflowParams",
    "execution": "detectors.config.common:ExecutionParams",
    "qa": "detectors.config.early:QAParams",
    "build_early": "detectors.config.early:BuildEarlyParams",
    "train_early": "detectors.config.early:TrainEarlyParams",
    "register_early": "detectors.config.early:RegisterEarlyParams",
    "articles": "detectors.config.realtime:ArticlesParams",
    "build_realtime": "detectors.config.realtime:BuildRealtimeParams",
    "train_realtime": "detectors.config.realtime:TrainRealtimeParams",
    "register_realtime": "detectors.config.common:RegisterParams",
    "score_baselines": "detectors.config.evaluation:ScoreBaselinesParams",
    "evaluate": "detectors.config.evaluation:EvaluateParams",
    "extract_directions": "detectors.config.ctrla:ExtractDirectionsParams",
    "evaluate_directions": "detectors.config.ctrla:EvaluateDirectionsParams",
    "register_ctrla": "detectors.config.ctrla:RegisterCtrlAParams",
    "index_corpus": "detectors.config.rag:IndexCorpusParams",
    "rag_eval": "detectors.config.rag:RagEvalParams",
    "retrorag": "detectors.config.retrorag:RetroRagParams",
    "build_utility": "detectors.config.utility:BuildUtilityParams",
    "train_utility": "detectors.config.utility:TrainUtilityParams",
    "register_utility": "detectors.config.common:RegisterParams",
}


def _entry(name: str) -> tuple[str, str]:
    if name not in SECTIONS:
        raise ParamsError(f"no params section named {name!r}; known: {sorted(SECTIONS)}")
    module, _, cls = SECTIONS[name].partition(":")
    return module, cls


def section_type(name: str) -> type:
    """The dataclass that validates section ``name`` (a :class:`ParamsError` listing the known sections if none)."""
    module, cls = _entry(name)
    return getattr(importlib.import_module(module), cls)


def section_modules(reads: Iterable[str]) -> set[str]:
    """The modules whose types validate the sections that the declared keys ``reads`` (``section`` or
    ``section.key``) belong to."""
    return {_entry(key.split(".", 1)[0])[0] for key in reads}
