"""The detectors inside vLLM's engine: per request, in the batch, from the forward pass that generates the tokens.

:class:`EngineDetectors` lives in vLLM's worker (one per engine) and hooks its V1 model runner:

- ``execute_model``: requests that finished leave (their results are kept for the front end to fetch);
- ``_model_forward``: before each forward pass, which rows of the flattened batch belong to which request asking
  for a detector or a steering (vLLM's ``query_start_loc`` and the rows' positions, ``num_computed_tokens``);
- forward hooks on the decoder blocks and the final norm the loaded detectors read: a steering direction is added to
  the residual stream of the steered requests' rows only; the real-time detector's hidden states are taken at the rows
  of generated tokens (vLLM's blocks return the residual stream as ``(delta, residual)``: their sum is transformers'
  ``hidden_states[l]``); CtrlA's projections at every row of a monitored request (the prompt's too: Eq. 2 reads them);
- ``_sample``: the tokens whose features are complete are scored with the detector's own functions
  (:meth:`~detectors.dior.realtime_detector.RealtimeDetector.score_tokens`, i.e.
  :func:`~detectors.dior.recorder.feature_rows` and the MLP; :func:`~detectors.ctrla.monitor.running_scores` over
  :meth:`~detectors.ctrla.monitor.ConfidenceMonitor.project`); a request that asked to stop and whose token reached
  the threshold gets its end-of-sequence token as the only choice; each sampled token's probability and the entropy
  of its distribution are kept for its features (the next pass computes its hidden states), and returned to a request
  that asks for them (``stats``); a request that asks to end at a sentence end (``sentence``) gets its end-of-sequence
  token as the only choice after a token that ends a sentence (a mask over the vocabulary, made once per engine).

A generated token is scored in the pass that runs it, one step after it was chosen, as in the Hugging Face path
(:class:`~detectors.dior.recorder.GenerationRecorder`): the last token of a request cut at its token budget never runs
and has no score. Scores stay on the device until the front end asks for them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import torch

from detectors.ctrla.monitor import ConfidenceMonitor, running_scores
from detectors.interfaces import Detector
from detectors.llm.distribution import entropy
from detectors.llm.fingerprint import Fingerprint
from detectors.llm.layers import decoder, decoder_layers
from detectors.llm.words import ends_sentence
from detectors.serving.requests import (
    DETECTOR,
    RESULT_KEY,
    STOP_TOKEN,
    STOPPING_TRIGGERS,
    DetectorRequest,
    ServingRequestError,
    Spec,
    check_kind,
)

log = logging.getLogger(__name__)

KEPT_RESULTS = 4096  # results of finished requests kept for the front end, oldest dropped first
RUNNER_PARTS = ("execute_model", "_model_forward", "_sample", "input_batch", "query_start_loc", "requests")


@dataclasses.dataclass(frozen=True)
class ServedLLM:
    """What a detector checks of the LLM it is served with (:meth:`~detectors.interfaces.Detector.check_llm`)."""

    fingerprint: Fingerprint
    dtype_name: str


def served_llm(model: str, dtype: torch.dtype) -> ServedLLM:
    """The fingerprint of the checkpoint vLLM serves (``model``: its directory or source), computed as the Hugging
    Face path computes it (:class:`~detectors.llm.fingerprint.Fingerprint` of the transformers model, loaded once on
    the CPU in bfloat16: the digest rounds weights to bfloat16), and the dtype vLLM runs it in."""
    from detectors.llm.loading import load_llm

    llm = load_llm(model, dtype="bfloat16", device="cpu")
    fingerprint = llm.fingerprint
    del llm
    return ServedLLM(fingerprint, str(dtype).removeprefix("torch."))


@dataclasses.dataclass
class Loaded:
    """A registered detector or steering loaded in the engine, and the sites it reads or writes: ``("block", l)`` the
    residual stream after block l, ``("norm",)`` the final norm's output (``hidden_states[L]``)."""

    spec: str
    kind: str
    trigger: str | None  # the detector's ``TRIGGER`` (None for a steering direction)
    detector: Detector
    sites: list[tuple]
    monitor: ConfidenceMonitor | None = None
    steering: dict[float | None, dict[int, torch.Tensor]] = dataclasses.field(default_factory=dict)  # lam -> vectors

    @property
    def threshold(self) -> float | None:
        return getattr(self.detector, "threshold", None) if self.trigger in STOPPING_TRIGGERS else None


@dataclasses.dataclass
class Tracked:
    """One request asking for the detectors, as the engine follows it."""

    key: str  # the front end's request id (``extra_args[RESULT_KEY]``)
    request: DetectorRequest
    prompt_len: int
    detector: Loaded | None
    steering: Loaded | None
    stop_token: int | None
    scores: list[tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=list)  # (a step's scores, where)
    n_scored: int = 0
    pending: tuple[torch.Tensor, int] | None = None  # the last sampled token's (probability, entropy): (a step's, row)
    projections: list[torch.Tensor] = dataclasses.field(default_factory=list)  # CtrlA: [rows, layers] chunks
    n_projected: int = 0
    error: str | None = None
    token_stats: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)  # (a step's [rows, 2], row)
    ends: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)  # (a step's sentence ends, row)

    def info(self) -> dict[str, Any]:
        scores = torch.cat([s[at].reshape(-1) for s, at in self.scores]).float().cpu().tolist() if self.scores else []
        lam = self.request.lam
        if self.steering is not None and lam is None:
            lam = float(self.steering.detector.params.lam)
        stats = torch.stack([s[j] for s, j in self.token_stats]).float().cpu() if self.token_stats else None
        return {
            "probs": [] if stats is None else stats[:, 0].tolist(),
            "entropies": [] if stats is None else stats[:, 1].tolist(),
            "ends": torch.stack([e[j] for e, j in self.ends]).cpu().tolist() if self.ends else [],
            "kind": None if self.detector is None else self.detector.kind,
            "threshold": None if self.detector is None else self.detector.threshold,
            "scores": scores[: self.n_scored],
            "lam": lam,
            "stop_token": self.stop_token,
            "error": self.error,
        }


@dataclasses.dataclass
class Step:
    """What one forward pass does for the tracked requests in its batch."""

    steer: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=dict)  # block ->
    capture: dict[tuple, list[tuple[tuple, torch.Tensor, Any]]] = dataclasses.field(default_factory=dict)  # site ->
    captured: dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)
    realtime: dict[str, list[tuple[Tracked, int]]] = dataclasses.field(default_factory=dict)  # spec -> (t, batch row)
    confidence: dict[str, list[tuple[Tracked, int, int]]] = dataclasses.field(default_factory=dict)  # (t, first, n)
    sampled: list[tuple[Tracked, int]] = dataclasses.field(default_factory=list)  # rows whose distribution is read


class EngineDetectors:
    """The registered detectors of one vLLM worker and the requests that use them (see the module's docstring)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.runner = worker.model_runner
        self.model = self.runner.get_model()
        self.device = next(self.model.parameters()).device
        self.num_layers = len(decoder_layers(self.model))
        self.loaded: dict[str, Loaded] = {}
        self.tracked: dict[str, Tracked] = {}  # vLLM's request id ->
        self.by_key: dict[str, Tracked] = {}
        self.plain: set[str] = set()  # requests that ask nothing of the detectors
        self.done: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.step: Step | None = None
        self._served: ServedLLM | None = None
        self._executing = False
        self._installed = False
        self._hooked: set[tuple] = set()
        self._ends: torch.Tensor | None = None  # which token ids end a sentence

    # ---- loading --------------------------------------------------------------------------------------------------
    def served(self) -> ServedLLM:
        if self._served is None:
            config = self.worker.vllm_config.model_config
            self._served = served_llm(config.model, config.dtype)
        return self._served

    def load(self, spec: Spec, role: str, tracking_uri: str | None = None) -> Loaded:
        """Load ``spec`` from the MLflow registry once per engine, check its kind for ``role`` and its LLM against the
        served one, and hook what it reads; an :class:`~detectors.errors.InputError` says what is wrong."""
        loaded = self.loaded.get(str(spec))
        if loaded is None:
            self._check_engine()
            from detectors.inference import load_detector

            detector = load_detector(spec.name, spec.alias, tracking_uri=tracking_uri, load_llm=False)
            check_kind(spec, detector.KIND, detector.TRIGGER, role)
            detector.check_llm(self.served())
            loaded = self._loaded(str(spec), detector)
            self._install(loaded)
            self.loaded[str(spec)] = loaded
        check_kind(spec, loaded.kind, loaded.trigger, role)
        return loaded

    def _check_engine(self) -> None:
        missing = [p for p in RUNNER_PARTS if not hasattr(self.runner, p)]
        if missing:
            raise ServingRequestError(
                f"the detectors need vLLM's V1 model runner ({type(self.runner).__name__} has no {missing}): start the "
                "engine with VLLM_USE_V2_MODEL_RUNNER=0"
            )
        config = self.worker.vllm_config
        if config.parallel_config.tensor_parallel_size * config.parallel_config.pipeline_parallel_size != 1:
            raise ServingRequestError("the detectors run in an engine of one worker (tensor and pipeline parallel 1)")
        if config.speculative_config is not None:
            raise ServingRequestError("the detectors do not run with speculative decoding: start the engine without it")

    def _loaded(self, spec: str, detector: Detector) -> Loaded:
        kind, trigger = detector.KIND, detector.TRIGGER
        if trigger == "realtime":
            sites = [("block", i) if i < self.num_layers else ("norm",) for i in detector.state_indices]
            return Loaded(spec, kind, trigger, detector, sites)
        if trigger == "ctrla":
            monitor = detector.monitor(self.model)
            sites = [("block", layer) for layer in monitor.layers]
            return Loaded(spec, kind, trigger, detector, sites, monitor=monitor)
        return Loaded(spec, kind, trigger, detector, [("block", layer) for layer in detector.directions.layers])

    def install(self) -> None:
        """Hook the runner's steps (once): what every request that asks something of the engine needs."""
        if not self._installed:
            self._check_engine()
            self._wrap("execute_model", self._execute_model)
            self._wrap("_model_forward", self._model_forward)
            self._wrap("_sample", self._sample)
            self._installed = True

    def sentence_ends(self, size: int) -> torch.Tensor:
        """``[size]`` bool on the device: which token ids end a sentence (:func:`~detectors.llm.words.ends_sentence`
        with the served tokenizer; ids past the tokenizer's never do)."""
        if self._ends is None or len(self._ends) != size:
            from transformers import AutoTokenizer

            config = self.worker.vllm_config.model_config
            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
            known = min(len(tokenizer), size)
            mask = [ends_sentence(tokenizer, i) for i in range(known)] + [False] * (size - known)
            self._ends = torch.tensor(mask, device=self.device)
        return self._ends

    def _install(self, loaded: Loaded) -> None:
        self.install()
        blocks = decoder_layers(self.model)
        for site in loaded.sites:
            if site in self._hooked:
                continue
            module = decoder(self.model).norm if site[0] == "norm" else blocks[site[1] - 1]
            module.register_forward_hook(lambda m, a, out, site=site: self._hook(site, out))
            self._hooked.add(site)

    def _wrap(self, name: str, wrapper) -> None:
        original = getattr(self.runner, name)
        setattr(self.runner, name, lambda *a, **k: wrapper(original, *a, **k))

    # ---- requests -------------------------------------------------------------------------------------------------
    def _track(self, req_id: str) -> Tracked | None:
        tracked = self.tracked.get(req_id)
        if tracked is not None or req_id in self.plain:
            return tracked
        state = self.runner.requests.get(req_id)
        args = state.sampling_params.extra_args if state is not None and state.sampling_params is not None else None
        try:
            request = DetectorRequest.of(args)
        except ServingRequestError:  # the front end refuses it before it gets here; never score a bad request
            request = None
        if request is None or RESULT_KEY not in args:
            self.plain.add(req_id)
            return None
        tracked = Tracked(args[RESULT_KEY], request, state.num_prompt_tokens, None, None, args.get(STOP_TOKEN))
        try:
            tracked.detector = self.load(request.detector, DETECTOR) if request.detector is not None else None
            tracked.steering = self.load(request.steering, "steering") if request.steering is not None else None
        except Exception as err:  # loaded by the front end first; an engine reached another way says why here
            tracked.error, tracked.detector, tracked.steering = str(err), None, None
        self.tracked[req_id] = self.by_key[tracked.key] = tracked
        return tracked

    def _finish(self, req_id: str) -> None:
        self.plain.discard(req_id)
        tracked = self.tracked.pop(req_id, None)
        if tracked is None:
            return
        if self.by_key.get(tracked.key) is tracked:
            del self.by_key[tracked.key]
            self.done[tracked.key] = tracked.info()
            while len(self.done) > KEPT_RESULTS:
                self.done.popitem(last=False)

    def results(self, keys: list[str]) -> dict[str, dict]:
        """What the engine recorded of the requests the front end answers with ``keys`` (each given once)."""
        out = {}
        for key in keys:
            if key in self.done:
                out[key] = self.done.pop(key)
            elif key in self.by_key:
                out[key] = self.by_key.pop(key).info()
        return out

    # ---- the runner's steps ---------------------------------------------------------------------------------------
    def _execute_model(self, original, scheduler_output, *args, **kwargs):
        for req_id in scheduler_output.finished_req_ids:
            self._finish(req_id)
        self._executing = True
        try:
            return original(scheduler_output, *args, **kwargs)
        finally:
            self._executing = False

    def _model_forward(self, original, *args, **kwargs):
        self.step = self._plan() if self._executing else None
        return original(*args, **kwargs)

    def _plan(self) -> Step | None:
        """Which rows of this pass belong to which tracked request, and what each hook does with them."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        if not n:
            return None
        starts = self.runner.query_start_loc.np[: n + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:n].tolist()
        step, rows = Step(), collections.defaultdict(list)
        for i, req_id in enumerate(batch.req_ids[:n]):
            tracked = self._track(req_id)
            if tracked is None:
                continue
            start, count, first = starts[i], starts[i + 1] - starts[i], computed[i]
            if tracked.steering is not None:
                rows[("steer", tracked.steering.spec, tracked.request.lam)].extend(range(start, start + count))
            det = tracked.detector
            realtime = det is not None and det.trigger == "realtime"
            if realtime or tracked.request.stats or tracked.request.sentence:
                step.sampled.append((tracked, i))
            if det is None:
                continue
            if realtime:
                position = tracked.prompt_len + tracked.n_scored  # where the next token to score runs
                if tracked.pending is not None and first <= position < first + count:
                    rows[("capture", det.spec)].append(start + position - first)
                    step.realtime.setdefault(det.spec, []).append((tracked, i))
            else:
                new = max(first, tracked.n_projected)
                if new < first + count:
                    rows[("capture", det.spec)].extend(range(start + new - first, start + count))
                    step.confidence.setdefault(det.spec, []).append((tracked, new, first + count - new))
        for (what, spec, *lam), index in rows.items():
            index = torch.tensor(index, device=self.device)
            loaded = self.loaded[spec]
            if what == "steer":
                vectors = self._steering_vectors(loaded, lam[0])
                for layer, vector in vectors.items():
                    step.steer.setdefault(layer, []).append((index, vector))
            else:
                for slot, site in enumerate(loaded.sites):
                    slot = loaded.monitor.layers[slot] if loaded.monitor is not None else slot
                    step.capture.setdefault(site, []).append(((spec, slot), index, loaded.monitor))
        return step if rows or step.sampled else None

    def _steering_vectors(self, loaded: Loaded, lam: float | None) -> dict[int, torch.Tensor]:
        if lam not in loaded.steering:
            vectors = loaded.detector.vectors(lam)
            loaded.steering[lam] = {layer: v.to(self.device) for layer, v in vectors.items()}
        return loaded.steering[lam]

    def _hook(self, site: tuple, out):
        """A block's ``(delta, residual)`` output (or the final norm's): steer the steered rows, take what the
        detectors read (after steering, as the Hugging Face hooks do: steering hooks run first)."""
        step = self.step
        if step is None:
            return None
        if site[0] == "norm":
            stream = out[0] if isinstance(out, tuple) else out
            delta, residual, changed = None, None, False
        else:
            (delta, residual), changed = out, False
            for index, vector in step.steer.get(site[1], ()):
                if not changed:
                    residual, changed = residual.clone(), True
                residual[index] += vector.to(residual.dtype)
        for key, index, monitor in step.capture.get(site, ()):
            rows = stream[index] if delta is None else delta[index] + residual[index]
            step.captured[key] = rows if monitor is None else monitor.project(key[1], rows)
        return (delta, residual) if changed else None

    def _sample(self, original, logits, *args, **kwargs):
        step, self.step = self.step, None
        if step is None or logits is None:
            return original(logits, *args, **kwargs)
        if step.sampled:  # the distributions the sampler chooses from, before anything touches the logits
            logits = logits.float()  # the sampler's own first step, done once here: it gets these logits
            batch_rows = [i for _, i in step.sampled]
            rows = torch.tensor(batch_rows, device=logits.device)
            every_row = batch_rows == list(range(len(logits)))
            logp = torch.log_softmax(logits if every_row else logits[rows], dim=-1)
            ent = entropy(logp)
        for spec, entries in step.realtime.items():
            self._score_realtime(self.loaded[spec], entries, step, logits)
        for spec, entries in step.confidence.items():
            self._score_confidence(self.loaded[spec], entries, step)
        ending = [(t, i) for t, i in step.sampled if t.request.sentence and t.ends and t.stop_token is not None]
        if ending:  # after a sentence end, the end-of-sequence token is the only choice
            ended = torch.stack([t.ends[-1][0][t.ends[-1][1]] for t, _ in ending])
            _force_stop(logits, [i for _, i in ending], [t.stop_token for t, _ in ending], ended)
        output = original(logits, *args, **kwargs)
        if step.sampled:
            tokens = output.sampled_token_ids[rows, 0].to(logp.device).clamp_min(0)
            stats = torch.stack([logp.gather(1, tokens[:, None])[:, 0].exp(), ent], dim=1)
            ends = None
            if any(t.request.sentence for t, _ in step.sampled):
                ends = self.sentence_ends(logits.shape[-1]).to(tokens.device)[tokens]
            for j, (tracked, _) in enumerate(step.sampled):
                tracked.pending = (stats, j)
                if tracked.request.stats:
                    tracked.token_stats.append((stats, j))
                if tracked.request.sentence:
                    tracked.ends.append((ends, j))
        return output

    def _score_realtime(self, loaded: Loaded, entries: list[tuple[Tracked, int]], step: Step, logits) -> None:
        det = loaded.detector
        hidden = torch.cat([step.captured[(loaded.spec, slot)] for slot in range(len(loaded.sites))], dim=-1)
        pending = [t.pending for t, _ in entries]
        if all(p[0] is pending[0][0] for p in pending):  # all sampled in the same step: one gather
            stats = pending[0][0][torch.tensor([j for _, j in pending], device=pending[0][0].device)]
        else:
            stats = torch.stack([rows[j] for rows, j in pending])
        scores = det.score_tokens(hidden, stats[:, 0], stats[:, 1]).reshape(-1)
        for j, (tracked, _) in enumerate(entries):
            tracked.scores.append((scores, j))
            tracked.n_scored += 1
            tracked.pending = None
        stopping = [j for j, (t, _) in enumerate(entries) if t.request.stop and t.stop_token is not None]
        if stopping:  # where the score reached the threshold, the end-of-sequence token is the only choice
            hit = scores[torch.tensor(stopping, device=scores.device)] >= det.threshold
            _force_stop(logits, [entries[j][1] for j in stopping], [entries[j][0].stop_token for j in stopping], hit)

    def _score_confidence(self, loaded: Loaded, entries: list[tuple[Tracked, int, int]], step: Step) -> None:
        monitor = loaded.monitor
        projections = torch.stack([step.captured[(loaded.spec, layer)] for layer in monitor.layers], dim=-1)
        offset, scoring = 0, []
        for tracked, first, count in entries:
            tracked.projections.append(projections[offset : offset + count])
            tracked.n_projected = first + count
            offset += count
            if tracked.n_projected > tracked.prompt_len:
                scoring.append((tracked, max(first, tracked.prompt_len)))
        if not scoring:
            return
        sequences = [torch.cat(t.projections).mean(-1) for t, _ in scoring]  # Eq. 2's mean over the layers
        width = max(len(s) for s in sequences)
        padded = torch.stack([torch.nn.functional.pad(s, (0, width - len(s))) for s in sequences])  # right padding
        scores = running_scores(padded, monitor.tau, monitor.clip, monitor.skip)
        for b, (tracked, new) in enumerate(scoring):
            tracked.scores.append((scores[b], slice(new, tracked.n_projected)))
            tracked.n_scored += tracked.n_projected - new


def _force_stop(logits: torch.Tensor, rows: list[int], tokens: list[int], where: torch.Tensor) -> None:
    """Leave each of ``rows`` (of ``logits``) its stop token ``tokens`` as the only choice where ``where`` (a bool per
    row, on any device) holds; elsewhere its logits stay. On the device, with no host synchronisation."""
    index = torch.tensor(rows, device=logits.device)
    current = logits[index]
    forced = torch.full_like(current, float("-inf")).scatter_(
        1, torch.tensor(tokens, device=logits.device)[:, None], 0.0
    )
    logits[index] = torch.where(where.to(logits.device)[:, None], forced, current)
