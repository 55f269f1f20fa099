"""The retrieval-utility trigger: the corpus's trained retrieval decision before generating, and its gate on the
passages."""

from __future__ import annotations

import dataclasses

from detectors.rag.controllers.gate import Gated
from detectors.rag.families.dior import early
from detectors.rag.triggers import Trigger, TriggerContext, TriggerEntry
from detectors.utility.detector import UtilityGate


def build(context: TriggerContext, settings: None) -> Trigger:
    """DioR's early trigger on the utility detector's decision (a question trigger over its early-set columns), its
    firing gated on the passages."""
    return dataclasses.replace(early(context, settings), controller=Gated(UtilityGate(context.detector)))


UTILITY = TriggerEntry(build)
