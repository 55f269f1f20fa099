"""The RAG evaluation as the library runs it: which systems answer which questions (units of work, typed values a
worker runs in the caller's process or on Ray actors) and how each configuration's operating point is chosen on the
validation questions (the rules: :mod:`detectors.evaluation.rag_tuning`; the metrics of the answers:
:mod:`detectors.evaluation.rag_metrics`).

:func:`run_evaluation` is the whole procedure: every corpus's validation sweep (:class:`Sweep` of ``val``) proposes
the candidate thresholds (:func:`~detectors.evaluation.rag_tuning.tuning_candidates`); every configuration with a
threshold to choose answers the validation questions at each candidate (:class:`Tune`) and the rule of choices picks
its operating point (:func:`~detectors.evaluation.rag_tuning.choose_candidates`); then a corpus's configurations
answer the test questions together at their points (:class:`Answer`, with the test sweep on the sweep corpus) and each
framework its fixed sample of them (:class:`Framework`). Test questions choose nothing.

Every run is resumable (:func:`~detectors.rag.systems.run_questions`) under ``runs_dir/<corpus>/<run>``: a killed
evaluation resumes where it stopped, and a run whose key changed starts again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from detectors.config.rag import on_corpus
from detectors.errors import InputError
from detectors.evaluation.rag_metrics import check_failures
from detectors.evaluation.rag_sweep import curves as sweep_curves
from detectors.evaluation.rag_tuning import choose_candidates, tuning_candidates
from detectors.execution import map_units
from detectors.io import file_digest
from detectors.rag.runtime import RagRuntime
from detectors.rag.systems import Run, run_questions
from detectors.registry import store
from detectors.sources.ids import sample

SWEEP = "sweep"  # the test sweep's run, and the metrics file's key for the curves
VAL_SWEEP = "sweep-val"  # each corpus's sweep of the validation questions: the candidate thresholds of the tuning
TUNE = "tune-val"  # each corpus's configurations at their candidate thresholds on the validation questions
MIN_VALIDATION = 300  # validation questions a choice should rest on (fewer: a warning)

log = logging.getLogger("rag_eval")


# ---- units of work -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sweep:
    """The trigger sweep of ``corpus`` over the ``split`` questions (``test``: the curves; ``val``: the candidates)."""

    corpus: str
    split: str = "test"

    @property
    def name(self) -> str:
        return SWEEP if self.split == "test" else VAL_SWEEP

    def runs(self, runtime: RagRuntime, rows: pd.DataFrame, runs_dir: Path) -> list[Run]:
        refs = {q: list(a) for q, a in zip(rows["question"], rows["answers"])}
        return [Run(runtime.sweep(self.name, self.corpus, refs), runs_dir / self.corpus / self.name)]


@dataclasses.dataclass(frozen=True)
class Tune:
    """Each configuration of ``candidates`` (``{configuration: [{"label", "thresholds"}, ...]}``) at each of its
    candidates on ``corpus``'s validation questions (run ``<configuration>/<j>``), question-major."""

    corpus: str
    candidates: dict[str, list[dict[str, Any]]]
    split = "val"

    def runs(self, runtime: RagRuntime, rows: pd.DataFrame, runs_dir: Path) -> list[Run]:
        return [
            Run(
                dataclasses.replace(runtime.configuration(name, self.corpus, c["thresholds"]), name=f"{name}/{j}"),
                runs_dir / self.corpus / TUNE / name / str(j),
            )
            for name, sets in self.candidates.items()
            for j, c in enumerate(sets)
        ]


@dataclasses.dataclass(frozen=True)
class Answer:
    """The ``configurations`` of ``corpus`` at their ``thresholds`` on the test questions, question-major so that
    they share their decoding, and the test sweep with them when ``sweep``."""

    corpus: str
    configurations: tuple[str, ...]
    thresholds: dict[str, dict[str, float]]
    sweep: bool = False
    split = "test"

    def runs(self, runtime: RagRuntime, rows: pd.DataFrame, runs_dir: Path) -> list[Run]:
        prompts = runtime.params.prompts_sample
        return (Sweep(self.corpus).runs(runtime, rows, runs_dir) if self.sweep else []) + [
            Run(
                runtime.configuration(name, self.corpus, self.thresholds[name]),
                runs_dir / self.corpus / name,
                {},
                prompts,
            )
            for name in self.configurations
        ]


@dataclasses.dataclass(frozen=True)
class Framework:
    """Seed framework ``name`` (its own loop) on ``corpus``'s fixed sample of the test questions."""

    corpus: str
    name: str
    split = "frameworks"

    def runs(self, runtime: RagRuntime, rows: pd.DataFrame, runs_dir: Path) -> list[Run]:
        system = runtime.framework(self.name, self.corpus)
        return [Run(system, runs_dir / self.corpus / self.name, {}, runtime.params.prompts_sample)]


Unit = Sweep | Tune | Answer | Framework


class UnitWorker:
    """Answers the runs of one unit per call, resuming them; builds the LLM, retrievers and triggers once (in the
    caller's process or a Ray actor). ``rows``: the questions by split (``val``, ``test``, ``frameworks``);
    ``shared``: what shapes every run's answers besides the system (the QA table's digest, the prompt); ``champions``:
    the registered version each ``<name>@<alias>`` points to; ``engine``: the vLLM engine of ``rag_eval.engine: vllm``
    (None: built when a configuration first runs there, shut down by :meth:`close`). Returns each run's lines, the
    systems' keys and the digests that identify what answered them."""

    def __init__(
        self,
        params,
        rows: dict[str, pd.DataFrame],
        shared: dict[str, Any],
        champions: dict[str, str],
        engine: Any = None,
    ):
        self.runtime, self.rows, self.shared = RagRuntime(params, champions, engine), rows, shared
        self.runs_dir = Path(params["paths.rag_runs"])

    def close(self) -> None:
        self.runtime.close()

    def __call__(self, unit: Unit) -> dict[str, Any]:
        runtime = self.runtime
        runtime.forget_loops()
        corpus = runtime.corpus_digest(unit.corpus)
        shared = {**self.shared, "llm": runtime.llm_digest, "corpus": corpus, "questions": unit.split}
        rows = self.rows[unit.split]
        runs = [dataclasses.replace(r, shared=shared) for r in unit.runs(runtime, rows, self.runs_dir)]
        desc = f"{unit.corpus} · {runs[0].name if len(runs) == 1 else f'{len(runs)} runs'}"

        def on_shard(questions: list[str]) -> None:
            runtime.forget_shared()
            runtime.references(unit.corpus, questions)

        lines = run_questions(runs, rows, desc, runtime.params.shard_size, on_shard=on_shard)
        runtime.forget_loops()
        return {
            "llm": [runtime.llm_name, runtime.llm_digest],
            "corpus_digest": corpus,
            "lines": lines,
            "keys": {r.name: r.system.key for r in runs},
        }


# ---- the procedure -------------------------------------------------------------------------------------------


def split_questions(qa: pd.DataFrame, split: str, limit: int | None = None) -> pd.DataFrame:
    """The first ``limit`` questions of ``split`` by id hash (all of them for None), in the QA table's order."""
    missing = [c for c in ("id", "question", "answers", "split") if c not in qa.columns]
    if missing:
        raise InputError(f"the QA table lacks columns {missing}: rerun the prepare stage")
    rows = qa[qa["split"] == split].reset_index(drop=True)
    if rows.empty:
        raise InputError(f"the QA table has no {split} question: check qa.splits in params.yaml")
    return sample(rows, limit)


def evaluation_rows(qa: pd.DataFrame, rag) -> dict[str, pd.DataFrame]:
    """The questions of every split the evaluation reads: ``test`` (``rag.questions`` of them), ``val`` (all) and
    ``frameworks`` (``rag.framework_questions`` of the test ones)."""
    rows = {"test": split_questions(qa, "test", rag.questions), "val": split_questions(qa, "val")}
    rows["frameworks"] = sample(rows["test"], rag.framework_questions)
    return rows


def champion_versions(params) -> dict[str, str]:
    """The version (and its run id) each registered ``<name>@<alias>`` of the configurations points to now (triggers on
    every corpus and honesty steering): part of the key of every run that reads it, so that moving an alias
    (``promote``) outside the pipeline makes those runs compute again instead of resuming what another version
    answered."""
    rag = params["rag_eval"]
    specs = {on_corpus(t, c) for config in rag.configurations.values() for t in config.triggers for c in rag.corpora}
    specs |= {config.steering for config in rag.configurations.values() if config.steering}
    store.configure(params["mlflow"].tracking_uri)
    client, out = MlflowClient(), {}
    for spec in sorted(s for s in specs if "@" in s):
        name, alias = spec.split("@", 1)
        try:
            version = store.alias_version(client, name, alias)
        except MlflowException as err:  # no such registered model
            raise InputError(
                f"rag_eval uses {spec}, but {name} is not registered in {params['mlflow'].tracking_uri}: "
                "run the register stages "
                f"first ({err.error_code})"
            ) from err
        if version is None:
            raise InputError(
                f"rag_eval uses {spec}, but {name} has no alias {alias!r} in {params['mlflow'].tracking_uri}: "
                "run the register stages first"
            )
        out[spec] = f"{version.version}:{version.run_id}"  # the run id tells a version 1 of another store apart
    return out


@dataclasses.dataclass
class Evaluation:
    """What :func:`run_evaluation` answered: ``lines`` (``{corpus: {system: [line per question]}}``), the test
    sweep's lines and swept triggers' kinds, each configuration's candidates and choice on validation (``tuning``)
    and thresholds, the LLM's name and digest and the corpora's digests."""

    lines: dict[str, dict[str, list[dict]]]
    sweep: list[dict]
    sweep_triggers: dict[str, str]
    tuning: dict[str, dict[str, dict[str, Any]]]
    thresholds: dict[str, dict[str, dict[str, float]]]
    llm: tuple[str, str]
    corpora: dict[str, str]


def shared_inputs(params) -> dict[str, Any]:
    """What shapes every run's answers besides its system (each run adds its code, params, thresholds and
    champions): the QA table's digest, the prompt, the stop strings and the spaCy model."""
    return {
        "qa": file_digest(params["paths.qa"]),
        "prompt": dataclasses.asdict(params["build_early.features.prompt"]),
        "stop": list(params["build_early.stop"]),
        "spacy_model": params["build_realtime.spacy_model"],
    }


def _answerer(params, rows: dict[str, pd.DataFrame], shared: dict[str, Any]):
    """A function answering a list of units in order (locally, or on Ray actors), its worker built per call."""
    worker = functools.partial(UnitWorker, params, rows, shared, champion_versions(params))

    def answered(units: list) -> list[dict[str, Any]]:
        results: list[Any] = [None] * len(units)
        for i, result in map_units(units, worker, params["execution"]):
            results[i] = result
        return results

    return answered


@dataclasses.dataclass
class OperatingPoints:
    """What the validation half of the evaluation chose, by corpus: the rule's ``tuning`` of the configurations with
    more than one candidate, the ``thresholds`` every configuration runs at, and the corpora's digests."""

    tuning: dict[str, dict[str, dict[str, Any]]]
    thresholds: dict[str, dict[str, dict[str, float]]]
    corpora: dict[str, str]


def choose_operating_points(
    params, rows: dict[str, pd.DataFrame], shared: dict[str, Any], answered=None
) -> OperatingPoints:
    """The validation half of :func:`run_evaluation`: every corpus's validation sweep proposes the candidates, the
    configurations with more than one answer the validation questions at each, and the rule of choices picks their
    operating points. Reads ``rows["val"]`` only. ``answered``: the caller's unit runner (default: its own)."""
    rag = params["rag_eval"]
    answered = answered or _answerer(params, rows, shared)
    swept = dict(zip(rag.corpora, answered([Sweep(c, "val") for c in rag.corpora])))
    candidates = {
        c: tuning_candidates(
            rag.configurations,
            c,
            sweep_curves(swept[c]["lines"][VAL_SWEEP], list(swept[c]["keys"][VAL_SWEEP]["triggers"])),
            rag.thresholds,
            rag.candidate_rates,
        )
        for c in rag.corpora
    }
    # a configuration with nothing to choose (no threshold, or fixed ones) is not run on validation
    tried = {c: {name: sets for name, sets in candidates[c].items() if len(sets) > 1} for c in rag.corpora}
    to_tune = [c for c in rag.corpora if tried[c]]
    tuned = dict(zip(to_tune, answered([Tune(c, tried[c]) for c in to_tune])))
    val_answers = [list(a) for a in rows["val"]["answers"]]
    if len(val_answers) < MIN_VALIDATION:
        log.warning(
            "the operating points rest on %d validation questions, fewer than %d: raise qa.splits' val share or "
            "qa.limit",
            len(val_answers),
            MIN_VALIDATION,
        )
    tuning = {
        c: choose_candidates(tried[c], tuned[c]["lines"], val_answers, rag.bootstrap, rag.seed) if c in tuned else {}
        for c in rag.corpora
    }
    thresholds = {
        c: {
            name: tuning[c][name]["thresholds"] if name in tuning[c] else sets[0]["thresholds"]
            for name, sets in candidates[c].items()
        }
        for c in rag.corpora
    }
    for corpus, chosen in thresholds.items():
        log.info("%s: thresholds chosen on %d validation questions: %s", corpus, len(rows["val"]), chosen)
    return OperatingPoints(tuning, thresholds, {c: swept[c]["corpus_digest"] for c in rag.corpora})


def run_evaluation(params, rows: dict[str, pd.DataFrame], shared: dict[str, Any]) -> Evaluation:
    """The whole evaluation of the ``rag_eval`` params (see the module's docstring) over ``rows``
    (:func:`evaluation_rows`); ``shared``: what shapes every run's answers besides its system
    (:func:`shared_inputs`)."""
    rag = params["rag_eval"]
    answered = _answerer(params, rows, shared)
    points = choose_operating_points(params, rows, shared, answered)
    tuning, thresholds = points.tuning, points.thresholds
    # a corpus's configurations in one unit (answered question-major, so that they share their decoding), the test
    # sweep with those of its corpus; a configuration that never retrieves answers the same on every corpus: run once;
    # each framework its own unit, on its sample of the test questions
    first = rag.corpora[0]
    units: list[Unit] = []
    for corpus in rag.corpora:
        names = tuple(n for n, config in rag.configurations.items() if config.triggers or corpus == first)
        if names or corpus == rag.sweep.corpus:
            units.append(Answer(corpus, names, thresholds[corpus], corpus == rag.sweep.corpus))
    units += [Framework(corpus, name) for corpus in rag.corpora for name in rag.frameworks]
    results = answered(units)
    by_run = {(u.corpus, name): run for u, r in zip(units, results) for name, run in r["lines"].items()}
    lines = {
        corpus: {
            **{
                name: by_run[(corpus, name) if config.triggers else (first, name)]
                for name, config in rag.configurations.items()
            },
            **{name: by_run[(corpus, name)] for name in rag.frameworks},
        }
        for corpus in rag.corpora
    }
    for (corpus, name), run in by_run.items():
        if name != SWEEP:
            check_failures(run, f"{corpus} · {name}")
    test_sweep = next(r for r in results if SWEEP in r["lines"])
    digests = {u.corpus: r["corpus_digest"] for u, r in zip(units, results)}
    return Evaluation(
        lines,
        test_sweep["lines"][SWEEP],
        test_sweep["keys"][SWEEP]["triggers"],
        tuning,
        thresholds,
        tuple(test_sweep["llm"]),
        {c: digests.get(c, points.corpora[c]) for c in rag.corpora},
    )
