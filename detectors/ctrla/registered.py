"""The registered CtrlA detectors: ``ctrla-honesty`` (a steering context manager) and ``ctrla-confidence``
(a monitor a RAG loop attaches to generation). Both load a :class:`~detectors.ctrla.directions.Directions`
artifact and refuse an LLM other than the one it was extracted from (or in another dtype, unless allowed).

    honesty = load_detector("ctrla-honesty")
    confidence = load_detector("ctrla-confidence", llm=honesty.llm)
    with honesty.steer(), confidence.monitor() as monitor:
        out = honesty.llm.model.generate(ids, max_new_tokens=32)
    scores = monitor.scores()          # Eq. 2 per position; < 0 = unconfident
    segment = confidence.generate(question)   # or everything at once: text, scores, retrieve, refusal, query
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from detectors.config.core import from_dict
from detectors.config.schema import MonitorParams, SteeringParams
from detectors.ctrla.directions import Directions
from detectors.ctrla.monitor import FIRING_RULE, ConfidenceMonitor, Segment, generate_segment
from detectors.ctrla.steering import steer, steering_vectors
from detectors.interfaces import Detector, Watch
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.loading import LLM
from detectors.registry.artifact import FrameInputs


class _CtrlADetector(Detector):
    """What both kinds share: the directions artifact; the LLM check names a layer-count mismatch first."""

    def __init__(self, directions: Directions):
        if f"ctrla-{directions.concept}" != self.KIND:
            raise ValueError(f"{type(self).__name__} needs a {self.KIND!r} artifact, got ctrla-{directions.concept}")
        self.directions = directions
        self.llm: LLM | None = None

    @classmethod
    def load(cls, directory: str | Path):
        return cls(Directions.load(directory))

    def save(self, directory: str | Path) -> Path:
        return self.directions.save(directory)

    @property
    def fingerprint(self) -> Fingerprint:
        return self.directions.fingerprint

    @property
    def llm_ref(self) -> dict:
        return self.directions.config.get("llm", {})

    def check_llm(self, llm: LLM, allow_dtype_mismatch: bool = False) -> None:
        self.directions.require_llm(llm, allow_dtype_mismatch)


class HonestySteering(_CtrlADetector):
    """Honesty steering (CtrlA Eq. 1) as a context manager over the LLM's generation."""

    KIND = "ctrla-honesty"
    INPUTS = FrameInputs({"question": "string"}, optional={"lam": "double"})

    @property
    def params(self) -> SteeringParams:
        return from_dict(SteeringParams, self.directions.config["steering"], "ctrla-honesty.steering")

    def vectors(self, lam: float | None = None) -> dict[int, torch.Tensor]:
        p = self.params
        return steering_vectors(self.directions, p.lam if lam is None else lam, self.directions.layers, p.relative)

    @contextlib.contextmanager
    def steer(self, lam: float | None = None) -> Iterator[dict[int, torch.Tensor]]:
        """Steer every token generated inside the block; hooks are removed on exit, also on errors."""
        with steer(self.require_llm().model, self.vectors(lam)) as vectors:
            yield vectors

    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        """pyfunc view: ``question`` (and optional ``lam``) in; the steered greedy ``answer`` out."""
        llm, p = self.require_llm(), self.params
        prompt = from_dict(MonitorParams, self.directions.config.get("monitor", {}), "ctrla-honesty.monitor").prompt
        answers = []
        for i, question in enumerate(frame["question"]):
            lam = float(frame["lam"].iloc[i]) if "lam" in frame else None
            ids, _ = llm.encode_prompt(str(question), prompt)
            answers.append(generate_segment(llm, ids, p.max_new_tokens, steering=self.vectors(lam)).text)
        return pd.DataFrame({"answer": answers})


class ConfidenceDetector(_CtrlADetector):
    """The confidence monitor (CtrlA Eq. 2) with the retrieval trigger, refusal detector and query masking."""

    KIND = "ctrla-confidence"
    DECIDES = "generation"
    TRIGGER = "ctrla"
    INPUTS = FrameInputs({"question": "string"})

    @property
    def params(self) -> MonitorParams:
        return from_dict(MonitorParams, self.directions.config["monitor"], "ctrla-confidence.monitor")

    def monitor(self, model: torch.nn.Module | None = None) -> ConfidenceMonitor:
        """A monitor to attach around generation (``with detector.monitor() as m: ...; m.scores()``); ``model``: hook
        that model's layers instead of the attached LLM's (a serving engine's copy of it)."""
        p = self.params
        model = model if model is not None else self.require_llm().model
        return ConfidenceMonitor(model, self.directions, self.directions.layers, p.tau, p.clip)

    def generate(
        self, question: str, steering: HonestySteering | None = None, max_new_tokens: int | None = None
    ) -> Segment:
        """One CtrlA step: generate (steered when ``steering`` is given) with the monitor attached."""
        llm, p = self.require_llm(), self.params
        ids, _ = llm.encode_prompt(question, p.prompt)
        vectors = steering.vectors() if steering is not None else None
        return generate_segment(
            llm,
            ids,
            max_new_tokens or p.max_new_tokens,
            monitor=self.monitor(),
            steering=vectors,
            question=question,
            refusal_patterns=p.refusal_patterns,
        )

    def watch(self, text: str, max_new_tokens: int | None = None, **needs: Any) -> Watch:
        """:meth:`generate` (unsteered) from ``text``, as a :class:`Watch`: CtrlA's trigger rule, the refusal and the
        rewritten query."""
        seg = self.generate(text, max_new_tokens=max_new_tokens)
        tokens = [self.require_llm().tokenizer.decode([t]) for t in seg.token_ids]
        extra = {"refusal": seg.refusal, "query": seg.query}
        return Watch(tokens, list(seg.scores), seg.trigger_position, FIRING_RULE, extra)

    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        """pyfunc view: ``question`` in; the answer, per-token scores, retrieve, refusal and query out."""
        segments = [self.generate(str(q)) for q in frame["question"]]
        return pd.DataFrame(
            [
                {
                    "text": s.text,
                    "scores": s.scores,
                    "new_content": s.new_content,
                    "retrieve": s.retrieve,
                    "refusal": s.refusal,
                    "query": s.query,
                }
                for s in segments
            ]
        )
