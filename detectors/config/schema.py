"""Settings that travel inside artifacts and that library functions take (never a stage's section).

These types keep defaults: an artifact written before a key existed still loads. The pipeline reads
them strictly from ``params.yaml`` (every key given), so the defaults never stand in for a param.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from detectors.config.core import fail, positive

FEATURE_GROUPS = ("attribution", "entropy", "first_token", "hidden")


@dataclasses.dataclass(frozen=True)
class PromptParams:
    """How a question is put to the LLM; the detector stores it so serving uses the same prompt."""

    template: str = "{question}"
    chat: bool = True
    system: str | None = None

    def check(self, where: str) -> None:
        if self.template.count("{question}") != 1:
            fail(f"{where}.template", self.template, "must contain {question} exactly once")


@dataclasses.dataclass(frozen=True)
class EarlyFeatureParams:
    """The features of one question, computed identically by build_early and by the served detector."""

    prompt: PromptParams = dataclasses.field(default_factory=PromptParams)
    n_steps: int = 8
    method: Literal["gausslegendre", "riemann_trapezoid", "riemann_left", "riemann_right", "riemann_middle"] = (
        "gausslegendre"
    )
    ig_batch_size: int | None = None  # (question x step) rows per IG pass; None = memory-aware (attribution.auto_rows)
    hidden_layers: list[int] = dataclasses.field(default_factory=lambda: [-1])
    max_question_tokens: int = 128

    def check(self, where: str) -> None:
        positive(f"{where}.n_steps", self.n_steps)
        if self.ig_batch_size is not None:
            positive(f"{where}.ig_batch_size", self.ig_batch_size)
        positive(f"{where}.max_question_tokens", self.max_question_tokens)
        if not self.hidden_layers:
            fail(
                f"{where}.hidden_layers", self.hidden_layers, "name at least one layer (negative counts from the last)"
            )


def check_feature_groups(key: str, features: list[str]) -> None:
    if not features:
        fail(key, features, f"choose at least one of {list(FEATURE_GROUPS)}")
    for name in features:
        if name not in FEATURE_GROUPS:
            fail(key, name, f"unknown feature group; choose from {list(FEATURE_GROUPS)}")
    if len(set(features)) != len(features):
        fail(key, features, "a feature group is listed twice")


@dataclasses.dataclass(frozen=True)
class RealtimePromptParams:
    """DioR's continuation prompt; ``{title}`` and ``{text}`` (the truncated article) are filled in."""

    template: str = (
        "Below is the opening sentence from a Wikipedia article titled {title}. "
        "Please continue the passage from where the sentence ends.\n\n{text}"
    )
    chat: bool = False

    def check(self, where: str) -> None:
        if self.template.count("{text}") != 1 or not self.template.rstrip().endswith("{text}"):
            fail(f"{where}.template", self.template, "must end with {text} (the LLM continues the truncated article)")
        if self.template.count("{title}") > 1:
            fail(f"{where}.template", self.template, "use {title} at most once")


STRATEGIES = ("auto", "ddp_spawn", "ddp", "ddp_notebook")  # Lightning strategies for training.devices


@dataclasses.dataclass(frozen=True)
class TrainingParams:
    """How a detector network is trained (Lightning) and its threshold chosen; shared by both trainers."""

    hidden: int
    dropout: float
    lr: float
    weight_decay: float
    batch_size: int
    max_epochs: int
    patience: int
    threshold: Literal["youden", "f1", "prevalence"]
    seed: int
    accelerator: str
    devices: int = (
        1  # Lightning devices; more than one trains data-parallel (the train and val batches split across them)
    )
    strategy: str = (
        "auto"  # Lightning strategy; auto = ddp_spawn with several devices (fit returns the net to its caller)
    )
    seeds: int = (
        1  # nets trained with the seeds seed, seed + 1, ...; more than one are served as their mean probability
    )

    def check(self, where: str) -> None:
        for key in ("hidden", "lr", "batch_size", "max_epochs", "patience", "devices", "seeds"):
            positive(f"{where}.{key}", getattr(self, key))
        if self.strategy not in STRATEGIES:
            fail(
                f"{where}.strategy",
                self.strategy,
                f"use one of {', '.join(STRATEGIES)} (ddp relaunches the whole stage once per device)",
            )
        if not 0 <= self.dropout < 1:
            fail(f"{where}.dropout", self.dropout, "must be in [0, 1)")
        if not self.weight_decay >= 0:
            fail(f"{where}.weight_decay", self.weight_decay, "must be >= 0")


# ---- CtrlA -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StatementParams:
    """Carrier statements of the contrast pairs: ``qa`` (true/false statements from the QA facts) or a file."""

    source: str = "qa"
    text_field: str = "statement"
    label_field: str | None = "label"
    heldout: float = 0.2
    limit: int | None = 256
    max_tokens: int | None = 32

    def check(self, where: str) -> None:
        if not self.source.strip():
            fail(f"{where}.source", self.source, "use qa or a .csv/.jsonl/.json/.parquet statements file")
        if not 0 <= self.heldout < 1:
            fail(f"{where}.heldout", self.heldout, "must be in [0, 1)")
        for key in ("limit", "max_tokens"):
            if getattr(self, key) is not None:
                positive(f"{where}.{key}", getattr(self, key))


@dataclasses.dataclass(frozen=True)
class ContrastParams:
    """Prompt 3.1: the positive and negative instruction put before every statement."""

    positive: str
    negative: str
    statements: StatementParams = dataclasses.field(default_factory=StatementParams)
    chat: bool = True

    def check(self, where: str) -> None:
        for key in ("positive", "negative"):
            if not getattr(self, key).strip():
                fail(f"{where}.{key}", getattr(self, key), "the instruction must not be empty")
        if self.positive == self.negative:
            fail(f"{where}.negative", self.negative, "must differ from the positive instruction")


@dataclasses.dataclass(frozen=True)
class LayerRangeParams:
    """A CtrlA layer range given for a ``reference_layers``-deep LLM, scaled to the LLM's depth (blocks, 1-based)."""

    first: int
    last: int
    reference_layers: int = 32

    def check(self, where: str) -> None:
        positive(f"{where}.reference_layers", self.reference_layers)
        if not 1 <= self.first <= self.last <= self.reference_layers:
            fail(
                f"{where}",
                [self.first, self.last],
                f"need 1 <= first <= last <= reference_layers ({self.reference_layers})",
            )


@dataclasses.dataclass(frozen=True)
class SteeringParams:
    """Honesty steering (Eq. 1): ``lam`` times the unit direction (times the layer's mean residual norm when
    relative)."""

    layers: LayerRangeParams = dataclasses.field(default_factory=lambda: LayerRangeParams(5, 18, 32))
    lam: float = 0.02
    relative: bool = True
    max_new_tokens: int = 32

    def check(self, where: str) -> None:
        positive(f"{where}.max_new_tokens", self.max_new_tokens)
        if self.lam != self.lam:
            fail(f"{where}.lam", self.lam, "must be a number")


@dataclasses.dataclass(frozen=True)
class MonitorParams:
    """Confidence monitor (Eq. 2), retrieval trigger, refusal patterns (App. B.3.1) and the served prompt."""

    layers: LayerRangeParams = dataclasses.field(default_factory=lambda: LayerRangeParams(10, 25, 32))
    tau: float = 0.0
    clip: float = 3.0
    refusal_patterns: list[str] = dataclasses.field(default_factory=list)
    prompt: PromptParams = dataclasses.field(default_factory=PromptParams)
    max_new_tokens: int = 32

    def check(self, where: str) -> None:
        positive(f"{where}.clip", self.clip)
        positive(f"{where}.max_new_tokens", self.max_new_tokens)
        for i, pattern in enumerate(self.refusal_patterns):
            try:
                re.compile(pattern)
            except re.error as err:
                fail(f"{where}.refusal_patterns[{i}]", pattern, f"not a valid regular expression ({err})")
