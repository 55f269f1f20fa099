"""CtrlA's trigger (Alg. 1, 3) and its calculator: the confidence monitor on the generation itself."""

from __future__ import annotations

import numpy as np

from detectors.baselines.ctrla_confidence import CtrlAConfidence
from detectors.config.triggers import CtrlARefusalParams
from detectors.ctrla.monitor import FIRING_THRESHOLD, ConfidenceMonitor, detect_refusal, new_content, pooled_scores
from detectors.ctrla.refusal import RefusalHandler
from detectors.interfaces import Level
from detectors.rag.controllers import RETRIEVE
from detectors.rag.controllers.refusal import RefusalRetry
from detectors.rag.stats import Calculator, SegmentView
from detectors.rag.triggers import Policy, Trigger, TriggerContext, TriggerEntry


class CtrlACalculator(Calculator):
    """CtrlA's monitor on the generation itself (its probe: the projections of every position at the
    detector's layers, under whatever steering the loop runs): ``ctrla_eq2`` (Eq. 2 of each generated token over the
    running sequence), ``ctrla_confidence`` (its negation, the real-time set's CtrlA score), ``new_content`` (the
    tokens of new non-stopword words, the only ones CtrlA's trigger reads) and ``refusal`` (App. B.3.1). A serving
    engine that loaded the detector as ``served`` gives ``ctrla_eq2`` itself (the same running statistics over the
    request's prompt, the loop's context, and its tokens)."""

    key, provides = "ctrla", ("ctrla_eq2", "ctrla_confidence", "new_content", "refusal")

    def __init__(self, detector, served: str | None = None):
        self.detector, self.params, self.served = detector, detector.params, served or None
        self.probe = ConfidenceMonitor(detector.llm.model, detector.directions)

    def segments(self, views: list[SegmentView]) -> None:
        tok = self.detector.llm.tokenizer
        for v in views:  # the probe's values cover exactly context + segment
            if "ctrla_eq2" in v.stats:  # the engine's
                eq2 = np.asarray(v.stats["ctrla_eq2"], np.float64)
            else:
                eq2 = pooled_scores(v.probes[self.key], self.params.tau, self.params.clip)[len(v.context_ids) :]
                eq2 = eq2.astype(np.float64)
            v.stats["ctrla_eq2"], v.stats["ctrla_confidence"] = eq2, -eq2
            preceding = tok.decode(v.kept_ids, skip_special_tokens=True)  # y<t
            v.stats["new_content"] = np.asarray(new_content(tok, v.question, preceding, v.gen_ids), dtype=bool)
            v.stats["refusal"] = bool(detect_refusal(v.text, list(self.params.refusal_patterns)))


def build(context: TriggerContext, settings: CtrlARefusalParams | None) -> Trigger:
    """CtrlA's Alg. 3: retrieval when a new content word is unconfident or the segment refuses (f_d); the segment is
    re-predicted with the passages and kept (Alg. 1, lines 6-10), after the refusal handling H_R when ``settings``
    (``rag_eval.settings.ctrla-confidence``) gives it; the next segment is predicted without the passages (line 4).

    Unconfident is the monitor's :func:`~detectors.ctrla.monitor.unconfident` (Eq. 2 < 0; Eq. 2 already subtracts
    tau): the trigger's score is -Eq. 2 and its threshold :data:`~detectors.ctrla.monitor.FIRING_THRESHOLD`, CtrlA's
    own operating point. A threshold set later (``rag_eval.thresholds``, or the validation tuning) replaces it."""
    policy = Policy(
        "token", cut="segment", eligible="new_content", forced="refusal", after_retrieval="accept", passages="segment"
    )
    name, detector, controller = context.name, context.detector, RETRIEVE
    if settings is not None:
        controller = RefusalRetry(RefusalHandler(detector.llm, list(detector.params.refusal_patterns), settings))
    scorer = CtrlAConfidence(Level.TOKEN, name=name)
    calculator = CtrlACalculator(detector, context.spec)
    return Trigger(name, scorer, FIRING_THRESHOLD, policy, (calculator,), controller=controller)


CTRLA = TriggerEntry(build, CtrlARefusalParams)
