"""DioR's triggers: the early detector (before generating) and the real-time detector (each generated token, from the
hidden states of the loop's own passes), with the real-time detector's calculator."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from detectors.evaluation.scorers import DetectorScorer, realtime_detector_scorer
from detectors.interfaces import Level
from detectors.llm.layers import StateTap
from detectors.rag.families.early import EarlyCalculator
from detectors.rag.stats import Calculator, SegmentView
from detectors.rag.triggers import PROBABILITY, Policy, Trigger, TriggerContext, TriggerEntry


class MlpCalculator(Calculator):
    """``mlp``: the real-time detector's P(hallucination) of each generated token, from the hidden states the loop's
    own passes produced (its probe) and the token's probability and entropy, computed by the detector's
    serving function (:meth:`~detectors.dior.realtime_detector.RealtimeDetector.score_tokens`), or by a serving engine
    that loaded it as ``served``; lazily ``keywords``: the entity tokens of the generated text it does not flag (DioR
    §3.2, §3.3.1)."""

    key, provides, lazy = "mlp", ("mlp",), ("keywords",)

    def __init__(self, detector, served: str | None = None):
        self.detector, self.served = detector, served or None
        self.probe = StateTap(detector.llm.model, detector.state_indices)

    def segments(self, views: list[SegmentView]) -> None:
        hidden = torch.cat([v.at_segment(self.key) for v in views])
        prob = torch.from_numpy(np.concatenate([v.stats["prob"] for v in views]).astype(np.float32))
        entropy = torch.from_numpy(np.concatenate([v.stats["entropy"] for v in views]).astype(np.float32))
        device = hidden.device
        scores = (
            self.detector.score_tokens(hidden, prob.to(device), entropy.to(device)).reshape(-1).float().cpu().numpy()
        )
        for v, part in zip(views, np.split(scores.astype(np.float64), np.cumsum([len(v.gen_ids) for v in views])[:-1])):
            v.stats["mlp"] = part

    def lazy_stat(self, name: str, view: SegmentView) -> Any:
        """DioR §3.3.1 reads the entire generated text: the kept answer tokens (none flagged, or the trigger would have
        cut there) and the scored segment (asked of a segment that fired)."""
        kept = view.kept_ids
        return self.detector.keywords(kept + view.gen_ids, np.concatenate([np.zeros(len(kept)), view.stats["mlp"]]))


def early(context: TriggerContext, settings: None) -> Trigger:
    name, detector = context.name, context.detector
    return Trigger(
        name,
        DetectorScorer(name, detector),
        float(detector.threshold),
        Policy("question"),
        (EarlyCalculator(detector),),
        scores=PROBABILITY,
    )


def realtime(context: TriggerContext, settings: None) -> Trigger:
    name, detector = context.name, context.detector
    scorer = realtime_detector_scorer(Level.TOKEN, name)
    calculator = MlpCalculator(detector, context.spec)
    return Trigger(name, scorer, float(detector.threshold), Policy("token"), (calculator,), scores=PROBABILITY)


EARLY = TriggerEntry(early)
REALTIME = TriggerEntry(realtime)
