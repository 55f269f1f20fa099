"""The params sections of CtrlA's directions: ``extract_directions``, ``evaluate_directions``, ``register_ctrla``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from detectors.config.core import fail, positive
from detectors.config.schema import ContrastParams, MonitorParams, SteeringParams

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "extract_directions": "ExtractDirectionsParams",
    "evaluate_directions": "EvaluateDirectionsParams",
    "register_ctrla": "RegisterCtrlAParams",
}


@dataclasses.dataclass(frozen=True)
class ExtractDirectionsParams:
    honesty: ContrastParams
    confidence: ContrastParams
    steering: SteeringParams
    monitor: MonitorParams
    size_curve: list[int]
    batch_size: int
    seed: int

    def check(self, where: str) -> None:
        positive(f"{where}.batch_size", self.batch_size)
        for i, n in enumerate(self.size_curve):
            if n < 2:
                fail(f"{where}.size_curve[{i}]", n, "each size must be at least 2 statements")


@dataclasses.dataclass(frozen=True)
class TruthfulQAParams:
    """TruthfulQA multiple choice (bigbench ``truthful_qa/task_mc.json``), scored by answer log-likelihood."""

    task: str
    file: str
    limit: int | None
    lambdas: list[float]
    few_shot: bool

    def check(self, where: str) -> None:
        if self.limit is not None:
            positive(f"{where}.limit", self.limit)
        if 0.0 not in self.lambdas:
            fail(f"{where}.lambdas", self.lambdas, "include 0 (no steering) as the reference")


@dataclasses.dataclass(frozen=True)
class EvaluateDirectionsParams:
    truthfulqa: TruthfulQAParams
    eval_instruction: str
    batch_size: int
    score_realtime: bool  # per-token CtrlA scores of the real-time set (paths.realtime) for evaluate
    layer_window: int | None  # width of the layer window chosen on validation (None: the paper range's width)
    experiment: str

    def check(self, where: str) -> None:
        positive(f"{where}.batch_size", self.batch_size)
        if self.layer_window is not None:
            positive(f"{where}.layer_window", self.layer_window)


@dataclasses.dataclass(frozen=True)
class RegisterCtrlAParams:
    honesty_name: str
    confidence_name: str
    # the range the registered artifact uses (evaluate_directions reports both)
    honesty_layers: Literal["paper", "validation"]
    confidence_layers: Literal["paper", "validation"]
    alias: str
    experiment: str
