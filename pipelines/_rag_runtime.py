"""What the rag_eval stage runs to answer its questions: the LLM, the corpora's retrievers, the triggers, one RAG loop
per configuration (or a framework's own loop), each wrapped as ``answer(questions, record_prompts) -> [dict]``
(JSON-able RagResults, one per question), and the resumable runs that store the answers (:func:`run_questions`,
:class:`RunWorker`). The runs are keyed on this module's import closure: the code that answers, not the stage's
reporting.

The loops of a unit share their decoding (:class:`~detectors.rag.decoder.Shared`, one per steering): before a shard
of questions, the reference decodings (no retrieval; one retrieval with the question before generating) run from
nothing else, with every probe the unit's loops read (:meth:`RagRuntime.references`), and every loop then takes
their segments where it has not retrieved, or retrieved as they did: a configuration whose triggers do not fire
answers as no retrieval does, token for token, in every unit, stage run and resumed shard, and the candidate
thresholds of a configuration decode together until they part."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from detectors.config.rag import on_corpus, references, trigger_names
from detectors.errors import InputError
from detectors.evaluation.answer_metrics import FAILED
from detectors.evaluation.rag_sweep import sweep_line, trace_events
from detectors.execution import LLMSpec
from detectors.extensions import FRAMEWORKS, make_query
from detectors.inference import load_detector
from detectors.progress import progress
from detectors.rag.decoder import Shared
from detectors.rag.kinds import make_trigger
from detectors.rag.loop import RagConfig, RagLoop
from detectors.rag.queries import QuestionQuery
from detectors.rag.results import RagResult, result
from detectors.rag.retriever import BM25Retriever, open_index
from detectors.rag.triggers import TriggerSettings, check_threshold
from detectors.registry import store
from detectors.shards import ERROR, OK, ShardStore
from pipelines._provenance import closure_digest

log = logging.getLogger("rag_eval")

Answer = Callable[[list[str], list[bool]], list[dict]]
SWEEP = "sweep"  # the test sweep's run, and the metrics file's key for the curves
VAL_SWEEP = "sweep-val"  # each corpus's sweep of the validation questions: the candidate thresholds of the tuning
# each corpus's configurations at their candidate thresholds on the validation questions: the operating points
TUNE = "tune-val"


# modules that dispatch by name (registries, the runtime's builders): their function-level imports and registry entries
# are not part of a run's code; the modules of what a run actually built are (run_code)
DISPATCH = (
    "pipelines._rag_runtime",
    "detectors.rag.kinds",
    "detectors.extensions",
    "detectors.rag.queries",
    "detectors.registry.kinds",
    "detectors.config.sections",
    "detectors.inference",
)


def run_modules(triggers: list, *parts: Any) -> set[str]:
    """The modules a run executes: the runtime, the loop, and the modules of what it built (each trigger's family
    module and parts, the query formulation, the steering detector, a framework). Their import closure, the dispatching
    modules' other branches left out (:data:`DISPATCH`), is the run's code (:func:`run_code`)."""
    modules = {"pipelines._rag_runtime", "detectors.rag.loop", *(t.source for t in triggers if t.source)}
    return (
        modules
        | {type(p).__module__ for t in triggers for p in t.parts()}
        | {type(p).__module__ for p in parts if p is not None}
    )


def run_code(triggers: list, *parts: Any) -> str:
    """The digest of the code a run executes (:func:`run_modules`): a change to one family's code (CtrlA's rule,
    Stitch-in-Time's validator) changes the key of the runs that use it only."""
    return closure_digest(run_modules(triggers, *parts), DISPATCH)


def run_params(rag, config, triggers: list) -> dict[str, Any]:
    """The ``rag_eval`` params that shape a configuration's answers: the loop's budget and context, its own entry, and
    the sections only some systems read (the query's settings, Stitch-in-Time's validation, CtrlA's refusal handling)
    only where its query or triggers read them."""
    out: dict[str, Any] = {k: getattr(rag, k) for k in ("k", "max_retrievals", "max_new_tokens", "context")}
    out["configuration"] = dataclasses.asdict(config)
    out.update(make_query(config.query, rag.query).settings())  # the settings its formulation reads
    for section in dict.fromkeys(t.controller.section for t in triggers if t.controller.section):
        out[section] = dataclasses.asdict(getattr(rag, section))
    return out


def resilient(name: str, answer_all: Callable[[list[str], list[bool]], list[RagResult]]) -> Answer:
    """``answer_all`` as JSON-able dicts; when a batch raises, its questions are answered one by one, so that only the
    question that raises is recorded as failed (``failed: <error>``) and the others are answered."""

    def answer(questions: list[str], records: list[bool]) -> list[dict]:
        try:
            return [dataclasses.asdict(r) for r in answer_all(questions, records)]
        except Exception:  # noqa: BLE001 - retried one by one below, where a question's own failure is recorded
            if len(questions) == 1:
                raise
            log.warning("%s: a batch of %d questions raised; answering them one by one", name, len(questions))
        out = []
        for question, record in zip(questions, records):
            try:
                out.append(dataclasses.asdict(answer_all([question], [record])[0]))
            except Exception as err:  # recorded, never a crash halfway; the stage stops if most questions fail
                log.exception("%s: %r failed", name, question)
                out.append(dataclasses.asdict(result(question, "", [], 0, 0, 0.0, [], f"{type(err).__name__}: {err}")))
        return out

    return answer


class RagRuntime:
    """The stage's LLM, retrievers (loaded once per corpus) and triggers (loaded once per name)."""

    def __init__(self, params):
        self.stage_params, self.params = params, params["rag_eval"]
        self.llm = LLMSpec.of(params).load()
        self.llm_name, self.llm_digest = self.llm.fingerprint.name, store.llm_digest(self.llm.fingerprint)
        self.tracking_uri = store.configure(params["mlflow"].tracking_uri)
        self._retrievers: dict[str, BM25Retriever] = {}
        self._triggers: dict[str, Any] = {}
        self._states: dict[str, Shared] = {}  # per steering: what every configuration's loop ran
        # per steering, of the loops built since forget_loops: the loops, every probe they read, the steering vectors
        self._loops: dict[str, list[RagLoop]] = {}
        self._probes: dict[str, dict[str, Any]] = {}
        self._steering: dict[str, Any] = {}

    def states(self, steering: str | None) -> Shared:
        """What the loops that run under ``steering`` share (a prompt one configuration ran, or a segment it
        decoded, another does not run again)."""
        return self._states.setdefault(steering or "", Shared())

    def forget_states(self) -> None:
        """Drop what the loops share (they moved on to other questions)."""
        for shared in self._states.values():
            shared.clear()

    def forget_loops(self) -> None:
        """The loops built so far are done with (a unit of runs ended): the references decode for the next ones."""
        self._loops.clear()
        self._probes.clear()
        self._steering.clear()
        self.forget_states()

    def _built(self, loop: RagLoop, steering: str | None, vectors: Any = None) -> RagLoop:
        """``loop`` is one the references decode for: its probes join theirs."""
        self._loops.setdefault(steering or "", []).append(loop)
        self._probes.setdefault(steering or "", {}).update(loop.decoder.probes)
        self._steering[steering or ""] = vectors
        return loop

    def references(self, corpus: str, questions: list[str]) -> None:
        """The reference decodings of ``questions`` (a shard), before any loop built since :meth:`forget_loops`
        answers them: under each steering those loops run, no retrieval; unsteered, one retrieval with the question
        before generating on ``corpus`` (the ``always`` reference configuration's). Each decodes from nothing other
        loops ran, with every probe those loops read, and keeps its segments for them (see the module's docstring); and
        every loop records those probes too, so that one loop can take another's segments after a retrieval they
        share."""
        refs = references(self.params.configurations)
        for steering, probes in self._probes.items():
            for loop in self._loops[steering]:
                loop.decoder.attach(probes)
            shared = self.states(steering)
            config = self.rag_config("reference")
            vectors = self._steering.get(steering)
            RagLoop(self.llm, None, config, steering=vectors, shared=shared, probes=probes, reference=True).answer_all(
                questions
            )
            if steering or "always" not in refs:
                continue
            name = refs["always"]
            always = RagLoop(
                self.llm,
                self.retriever(corpus),
                self.rag_config(name, context=self.params.configurations[name].context),
                [self.trigger("always", corpus)],
                QuestionQuery(),
                shared=shared,
                probes=probes,
                reference=True,
            )
            always.answer_all(questions)

    def retriever(self, corpus: str) -> BM25Retriever:
        if corpus not in self._retrievers:
            self._retrievers[corpus] = open_index(Path(self.stage_params["paths.rag_index"]) / corpus)
        return self._retrievers[corpus]

    def corpus_digest(self, corpus: str) -> str:
        return self.retriever(corpus).digest

    def trigger(self, spec: str, corpus: str, thresholds: dict[str, float] | None = None):
        """Trigger ``spec`` for ``corpus`` (``{corpus}`` in a spec names the corpus: a utility trigger is trained per
        corpus) at its threshold in ``thresholds`` (by trigger name; None: a sweep, where no threshold is read)."""
        spec = on_corpus(spec, corpus)
        if spec not in self._triggers:  # built once, without a threshold: each loop sets its triggers' thresholds below
            settings = TriggerSettings(sit=self.params.sit, ctrla=self.params.ctrla)
            trigger = make_trigger(
                spec, self.llm, None, self.stage_params["build_realtime.spacy_model"], self.tracking_uri, settings
            )
            if trigger.name in self.params.thresholds:
                check_threshold(trigger, self.params.thresholds[trigger.name], f"rag_eval.thresholds.{trigger.name}")
            self._triggers[spec] = trigger
        trigger = self._triggers[spec]
        if thresholds is None or trigger.name == "always":
            return trigger
        if trigger.name not in thresholds:
            raise InputError(
                f"trigger {trigger.name!r} has no threshold on corpus {corpus!r}: "
                "its validation sweep did not measure it"
            )
        return dataclasses.replace(trigger, threshold=thresholds[trigger.name])

    def rag_config(
        self,
        name: str,
        stepwise: bool = False,
        chunk: bool = False,
        max_retrievals: int | None = None,
        context: str | None = None,
    ) -> RagConfig:
        r = self.params
        return RagConfig(
            name=name,
            prompt=self.stage_params["build_early.features.prompt"],
            context=r.context if context is None else context,
            k=r.k,
            max_retrievals=r.max_retrievals if max_retrievals is None else max_retrievals,
            max_new_tokens=r.max_new_tokens,
            stop=tuple(self.stage_params["build_early.stop"]),
            stepwise=stepwise,
            chunk=chunk,
            batch_size=r.batch_size,
        )

    def query(self, name: str, triggers: list, retriever: BM25Retriever | None):
        """Formulation ``name`` with the ``rag_eval.query`` settings, the FLARE trigger's threshold (FLARE's query
        masks words under 1 - it) and the retriever's idf."""
        flare = next((t.threshold for t in triggers if t.name == "flare"), None)
        return make_query(name, self.params.query, flare, getattr(retriever, "idf", None))

    def loop(self, name: str, config, corpus: str, thresholds: dict[str, float]) -> tuple[Answer, str]:
        """Configuration ``name`` (a ``rag_eval.configurations`` entry) over ``corpus``, its triggers at ``thresholds``,
        as ``answer(questions, records)``, and the digest of the code it runs (:func:`run_code`)."""
        triggers = [self.trigger(t, corpus, thresholds) for t in config.triggers]
        steering, steerer = None, None
        if config.steering:
            steer_name, alias = config.steering.split("@", 1)
            steerer = load_detector(steer_name, alias=alias, llm=self.llm, tracking_uri=self.tracking_uri)
            steering = steerer.vectors()
        retriever = self.retriever(corpus) if triggers else None
        query = self.query(config.query, triggers, retriever)
        rag = RagLoop(
            self.llm,
            retriever,
            self.rag_config(name, config.stepwise, config.chunk, context=config.context),
            triggers,
            query,
            steering,
            self.states(config.steering),
        )
        self._built(rag, config.steering, steering)
        return resilient(name, rag.answer_all), run_code(triggers, query, steerer)

    def framework(self, name: str, corpus: str) -> tuple[Answer, str]:
        """Seed system ``name`` of ``rag_eval.frameworks`` (its own loop, its params the section of its name) over
        ``corpus``, as ``answer(questions, records)``, and the digest of the code it runs."""
        rag = FRAMEWORKS.load(name)(
            self.llm,
            self.retriever(corpus),
            self.stage_params[name],
            self.stage_params["build_early.features.prompt"],
            self.params.batch_size,
        )
        return resilient(name, rag.answer_all), run_code([], rag)

    def sweep_loop(self, corpus: str) -> tuple[Callable[[list[str], list[list[str]]], list[dict]], dict[str, str], str]:
        """The sweep over ``corpus``: ``sweep(questions, references)`` (the stored lines), the swept triggers' kinds by
        name (``baseline``: training-free; ``detector``: trained), every trigger of the configurations but ``always``,
        which is the sweep's position-0 reference, and the digest of the code it runs."""
        specs = list(dict.fromkeys(t for c in self.params.configurations.values() for t in c.triggers if t != "always"))
        triggers = [self.trigger(t, corpus) for t in specs]
        retriever = self.retriever(corpus)
        rag = RagLoop(
            self.llm, retriever, self.rag_config("sweep", max_retrievals=1), triggers, shared=self.states(None)
        )  # the query is the job's (the question)
        self._built(rag, None)

        def sweep(questions: list[str], references: list[list[str]]) -> list[dict]:
            traces = rag.trace(questions)
            events = [trace_events(t) for t in traces]
            positions = [sorted({0} | {p for e in ev.values() for _, p in e}) for ev in events]
            jobs = [(t.question, t.gen_ids, p, t.question) for t, ps in zip(traces, positions) for p in ps]
            after = iter(rag.answer_after(jobs))
            lines = []
            for trace, ev, ps, refs in zip(traces, events, positions, references):
                results = {p: next(after) for p in ps}
                line = sweep_line(ev, trace.answer, {p: r.answer for p, r in results.items()}, refs)
                line["forward_passes"] = trace.forward_passes + sum(r.forward_passes for r in results.values())
                line["errors"] = {str(p): r.error for p, r in results.items() if r.error}
                lines.append(line)
            return lines

        return sweep, {t.name: t.scorer.kind for t in triggers}, run_code(triggers)


# ---- resumable runs ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One resumable run: its shard store's ``directory`` and ``key`` (what shapes its answers) and how it answers a
    chunk of questions, ``answer(questions, record_prompts) -> [dict]`` (JSON-able RagResults)."""

    name: str
    directory: Path
    key: dict[str, Any]
    answer: Answer
    prompts_sample: int = 0


def run_questions(
    runs: list[Run],
    rows: pd.DataFrame,
    desc: str,
    shard_size: int,
    on_shard: Callable[[list[str]], None] | None = None,
) -> dict[str, list[dict]]:
    """Answer every row (``id``, ``question``) in every run, question-major: shard after shard of ``shard_size``
    questions, each shard answered by every run that lacks it before the next (``on_shard(questions)`` is called with
    the shard's questions before each, so that what the runs share about a shard's questions, their decodings, stays
    small and is decoded first). Each run is a
    :class:`~detectors.shards.ShardStore` under its directory keyed on its key (another key starts it again): a killed
    stage resumes where it stopped. A row is ``id``, ``status`` (``error: …`` for a question whose loop raised, computed
    again by the next run) and ``line`` (its result as JSON); the first ``prompts_sample`` rows of a run record their
    prompts. Returns each run's lines of every row, in the rows' order."""
    ids = hashlib.sha256("\x1f".join(rows["id"]).encode()).hexdigest()[:16]  # the shards cover exactly these questions
    table = rows[["id", "question"]].reset_index(drop=True)
    stores = {
        r.name: ShardStore(r.directory, {**r.key, "questions_digest": ids, "shard_size": shard_size}) for r in runs
    }
    todo = {r.name: dict(stores[r.name].todo(table, shard_size)) for r in runs}
    shards = sorted({k for t in todo.values() for k in t})
    left = sum(len(chunk) for t in todo.values() for chunk in t.values())
    total = len(table) * len(runs)
    with progress(total=total, initial=total - left, desc=desc, unit="answer") as bar:
        for k in shards:
            if on_shard is not None:
                on_shard(list(table["question"].iloc[k * shard_size : (k + 1) * shard_size]))
            for r in runs:
                if k not in todo[r.name]:
                    continue
                chunk = todo[r.name][k]
                results = r.answer(list(chunk["question"]), [i < r.prompts_sample for i in chunk.index])
                status = [
                    f"{ERROR}{x['error']}" if str(x.get("error") or "").startswith(FAILED) else OK for x in results
                ]
                stores[r.name].write(
                    k,
                    pd.DataFrame({"id": list(chunk["id"]), "status": status, "line": [json.dumps(x) for x in results]}),
                )
                bar.update(len(chunk))
    out = {}
    for r in runs:
        frame = stores[r.name].read_all(len(table), shard_size)
        out[r.name] = [{"id": i, **json.loads(line)} for i, line in zip(frame["id"], frame["line"])]
    return out


class RunWorker:
    """Answers the questions of the runs of one unit per call, resuming them: a corpus's configurations (a tuple of
    names, answered question-major so that they share their prompts' states, each at its ``thresholds``), the tuning
    of a corpus's configurations on the validation questions (:data:`TUNE`: each configuration at each of its
    ``candidates``, question-major too), a framework, or a sweep (of the test questions, or of the validation ones);
    builds the LLM, retrievers and triggers once (in the stage's process or a Ray actor). Returns each run's lines and
    the digests that identify what answered them."""

    def __init__(
        self,
        params,
        rows: dict[str, pd.DataFrame],
        base_key: dict[str, Any],
        thresholds: dict[str, dict[str, dict[str, float]]] | None = None,
        candidates: dict[str, dict[str, list[dict[str, Any]]]] | None = None,
    ):
        self.runtime, self.rag, self.rows, self.base_key = RagRuntime(params), params["rag_eval"], rows, base_key
        # {corpus: {configuration: {trigger: threshold}}}, {corpus: {configuration: [{"label", "thresholds"}, ...]}}
        self.thresholds, self.candidates = thresholds, candidates
        self.runs_dir = Path(params["paths.rag_runs"])

    def _champions(self, specs: list[str]) -> dict[str, str]:
        """The registered versions the run's ``<name>@<alias>`` specs point to (a promotion restarts the runs that read
        it)."""
        return {s: self.base_key["champions"][s] for s in sorted(set(specs)) if s in self.base_key["champions"]}

    def _config_run(
        self,
        run: str,
        name: str,
        corpus: str,
        thresholds: dict[str, float],
        base: dict[str, Any],
        directory: Path,
        prompts: int,
    ) -> Run:
        """Configuration ``name`` over ``corpus`` at ``thresholds`` as the resumable run ``run``, keyed on its code,
        params, thresholds and champions."""
        runtime, config = self.runtime, self.rag.configurations[name]
        answer, code = runtime.loop(name, config, corpus, thresholds)
        triggers = [runtime.trigger(t, corpus) for t in config.triggers]
        names = {n for s in config.triggers for n in trigger_names(s, [corpus])}
        key = {
            **base,
            "code": code,
            "params": run_params(self.rag, config, triggers),
            "thresholds": {t: v for t, v in thresholds.items() if t in names},
            "champions": self._champions(
                [on_corpus(t, corpus) for t in config.triggers] + ([config.steering] if config.steering else [])
            ),
        }
        return Run(run, directory, key, answer, prompts)

    def _sweep_run(self, corpus: str, name: str, base: dict[str, Any], rows: pd.DataFrame, out: dict) -> Run:
        """The sweep ``name`` (:data:`SWEEP` or :data:`VAL_SWEEP`) of ``corpus`` over ``rows``; the swept triggers'
        kinds go in ``out["triggers"]``."""
        rag = self.rag
        sweep_loop, out["triggers"], code = self.runtime.sweep_loop(corpus)
        specs = [on_corpus(t, corpus) for c in rag.configurations.values() for t in c.triggers]
        key = {
            **base,
            "code": code,
            "params": {k: getattr(rag, k) for k in ("k", "max_new_tokens", "context")},
            "sweep": dataclasses.asdict(rag.sweep),
            "triggers": out["triggers"],
            "champions": self._champions(specs),
            "questions": name,
        }
        refs = {q: list(a) for q, a in zip(rows["question"], rows["answers"])}
        return Run(name, self.runs_dir / corpus / name, key, lambda qs, _: sweep_loop(qs, [refs[q] for q in qs]))

    def __call__(self, unit: tuple[str, str | tuple[str, ...]]) -> dict[str, Any]:
        """``unit``: a corpus and :data:`VAL_SWEEP`, :data:`TUNE`, a framework, or a tuple of the configurations
        (and :data:`SWEEP`) that answer the test questions together."""
        corpus, names = unit
        runtime, rag = self.runtime, self.rag
        runtime.forget_loops()
        base = {
            **{k: v for k, v in self.base_key.items() if k != "champions"},
            "llm": runtime.llm_digest,
            "corpus": runtime.corpus_digest(corpus),
        }
        out: dict[str, Any] = {"llm": [runtime.llm_name, runtime.llm_digest], "corpus_digest": base["corpus"]}
        if names == VAL_SWEEP:
            rows = self.rows["val"]
            runs = [self._sweep_run(corpus, names, base, rows, out)]
        elif names == TUNE:  # run name: <configuration>/<candidate index>
            rows = self.rows["val"]
            runs = [
                self._config_run(
                    f"{name}/{j}",
                    name,
                    corpus,
                    candidate["thresholds"],
                    {**base, "questions": names},
                    self.runs_dir / corpus / TUNE / name / str(j),
                    0,
                )
                for name, sets in self.candidates[corpus].items()
                for j, candidate in enumerate(sets)
            ]
        elif names in rag.frameworks:  # a seed system with its own loop; its params are the section of its name
            rows = self.rows["frameworks"]
            answer, code = runtime.framework(names, corpus)
            key = {**base, "code": code, "framework": names, "params": dataclasses.asdict(runtime.stage_params[names])}
            runs = [Run(names, self.runs_dir / corpus / names, key, answer, rag.prompts_sample)]
        else:
            rows = self.rows["test"]
            runs = [
                self._sweep_run(corpus, name, base, rows, out)
                if name == SWEEP
                else self._config_run(
                    name,
                    name,
                    corpus,
                    self.thresholds[corpus][name],
                    base,
                    self.runs_dir / corpus / name,
                    rag.prompts_sample,
                )
                for name in names
            ]
        desc = f"{corpus} · {names if isinstance(names, str) else f'{len(names)} runs'}"

        def on_shard(questions: list[str]) -> None:
            runtime.forget_states()
            runtime.references(corpus, questions)

        out["lines"] = run_questions(runs, rows, desc, rag.shard_size, on_shard=on_shard)
        runtime.forget_loops()
        return out
