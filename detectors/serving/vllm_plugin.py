"""The vLLM plugin (entry point ``vllm.general_plugins``: ``dynrag = detectors.serving.vllm_plugin:register``).

vLLM calls :func:`register` in each of its processes. It

- starts every engine eager and on vLLM's V1 model runner (the engine's hooks, :mod:`detectors.serving.engine`, see
  each layer's output; set ``DYNRAG_VLLM_PLUGIN=0`` to leave vLLM untouched);
- gives vLLM's workers three methods the front end calls by ``collective_rpc``: ``dynrag_load`` (load a registered
  detector in the engine, once per engine, and check it against the served LLM), ``dynrag_install`` (hook the engine
  for a request that loads nothing: token statistics, a stop at a sentence end) and ``dynrag_results``;
- makes each request that asks for a detector (:mod:`detectors.serving.requests`) skip reading the prefix cache when
  its detector reads the prompt (CtrlA's Eq. 2), salts the cache of a steered request (its states are not another
  request's), and notes where its results go and which token stops it;
- in ``LLM.generate`` and ``AsyncLLM.generate`` (``vllm serve``): loads the detectors a request names before it runs
  (a bad one is one :class:`vllm.exceptions.VLLMValidationError` line: HTTP 400, the server goes on), and attaches the
  results to the finished output (``completion.dynrag``; ``choices[i].dynrag`` in an HTTP completion; the stop reason
  ``detector:<name>@<alias>`` when the detector stopped the request, ``sentence`` when it ended at a sentence end).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from detectors.serving.requests import (
    DETECTOR,
    READS_PROMPT,
    RESULT_KEY,
    SENTENCE_REASON,
    STOP_TOKEN,
    DetectorRequest,
    ServingRequestError,
    Spec,
    check_stop,
    scored,
    stop_reason,
)

log = logging.getLogger(__name__)

DISABLE_ENV = "DYNRAG_VLLM_PLUGIN"  # "0": the plugin leaves vLLM untouched
_registered = False


def register() -> None:
    """vLLM's plugin entry point: patch this process's vLLM (idempotent)."""
    global _registered
    if _registered or os.environ.get(DISABLE_ENV, "1") == "0":
        return
    _registered = True
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the hooks read the V1 runner's batch

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.worker_base import WorkerBase

    EngineArgs.create_engine_config = _eager(EngineArgs.create_engine_config)
    InputProcessor.process_inputs = _processed(InputProcessor.process_inputs)
    LLM.generate = _offline(LLM.generate)
    AsyncLLM.generate = _online(AsyncLLM.generate)
    WorkerBase.dynrag_load = _worker_load
    WorkerBase.dynrag_install = _worker_install
    WorkerBase.dynrag_results = _worker_results
    try:
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError:  # an install without the OpenAI server
        return
    OpenAIServingCompletion.request_output_to_completion_response = _completion_response(
        OpenAIServingCompletion.request_output_to_completion_response
    )


# ---- engine configuration and requests ------------------------------------------------------------------------------


def _eager(create_engine_config):
    @functools.wraps(create_engine_config)
    def wrapper(self, *args, **kwargs):
        if not self.enforce_eager:
            log.info("dynrag: the detectors' hooks need eager execution: enforce_eager=True")
            self.enforce_eager = True
        return create_engine_config(self, *args, **kwargs)

    return wrapper


def _processed(process_inputs):
    """The engine request of a prompt, with what the detectors need set on its own copy of the params."""

    @functools.wraps(process_inputs)
    def wrapper(self, request_id, prompt, params, *args, **kwargs):
        engine_request = process_inputs(self, request_id, prompt, params, *args, **kwargs)
        params = engine_request.sampling_params
        request = _request(params)
        if request is None:
            return engine_request
        if params.n > 1:
            raise _invalid(ServingRequestError(f"n = {params.n}: the detectors score one completion per request"))
        params.extra_args[RESULT_KEY] = request_id
        token = (
            params.eos_token_id if params.eos_token_id is not None else next(iter(params.stop_token_ids or ()), None)
        )
        if request.stops and (token is None or params.min_tokens):
            raise _invalid(
                ServingRequestError(
                    "stop and sentence need a token that ends the request at once: keep the end-of-sequence token (no "
                    "ignore_eos, or give stop_token_ids) and no min_tokens"
                )
            )
        if token is not None:
            params.extra_args[STOP_TOKEN] = int(token)
        if request.steering is not None:
            salt = f"dynrag:{request.steering}:{request.lam}"
            engine_request.cache_salt = f"{engine_request.cache_salt or ''}|{salt}"
        return engine_request

    return wrapper


def _request(params) -> DetectorRequest | None:
    try:
        return DetectorRequest.of(getattr(params, "extra_args", None))
    except ServingRequestError as err:
        raise _invalid(err) from None


def _invalid(err: Exception) -> Exception:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(str(err))


def _params_list(params) -> list:
    if params is None:
        return []
    return list(params) if isinstance(params, list | tuple) else [params]


def _needed(requests: list[DetectorRequest | None]) -> list[tuple[Spec, str]]:
    return list(dict.fromkeys(load for r in requests if r is not None for load in r.loads()))


def _hooks_only(requests: list[DetectorRequest | None]) -> bool:
    """Whether a request asks the engine's hooks for something without loading a detector (its statistics, an end at
    a sentence end): the engine must then be hooked before it runs."""
    return any(r is not None and (r.stats or r.sentence) for r in requests)


def _answered(replies: list) -> list:
    """The workers' replies to a ``collective_rpc``, or the first error among them as one request error."""
    error = next((r["error"] for r in replies if isinstance(r, dict) and r.get("error")), None)
    if error:
        raise _invalid(ServingRequestError(error))
    return replies


def _kind_and_trigger(replies: list) -> tuple[str, str | None]:
    """The kind and trigger the workers loaded (``dynrag_load``'s replies), or the load's error as one request
    error."""
    reply = _answered(replies)[0]
    return reply["kind"], reply["trigger"]


def _check_detector(params, request: DetectorRequest, loaded: tuple[str, str | None]) -> None:
    """Refuse ``stop`` for a detector that cannot stop (``loaded``: its kind and trigger); a detector that reads the
    prompt's positions (CtrlA's Eq. 2) makes its request run its whole prompt instead of reading the prefix cache."""
    kind, trigger = loaded
    try:
        check_stop(request, kind, trigger)
    except ServingRequestError as err:
        raise _invalid(err) from None
    if trigger in READS_PROMPT:
        params.skip_reading_prefix_cache = True


def _merged(replies: list) -> dict[str, dict]:
    return {key: info for reply in replies if isinstance(reply, dict) for key, info in reply.items()}


def _attach(output, request: DetectorRequest, info: dict | None) -> None:
    """The detectors' results on a finished output: ``completion.dynrag``, and the stop reason when they stopped it."""
    completion = output.outputs[0]
    result = scored(request, info, list(completion.token_ids), (info or {}).get("stop_token"))
    completion.dynrag = result.to_dict() | {"error": (info or {}).get("error")}
    if result.stopped:
        completion.stop_reason = stop_reason(request.detector)
    elif result.sentence_end:
        completion.stop_reason = SENTENCE_REASON


# ---- offline: LLM.generate ------------------------------------------------------------------------------------------


def _offline(generate):
    @functools.wraps(generate)
    def wrapper(self, prompts, sampling_params=None, *args, **kwargs):
        requests = [_request(p) for p in _params_list(sampling_params)]
        if not any(requests):
            return generate(self, prompts, sampling_params, *args, **kwargs)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        kinds = {
            load: _kind_and_trigger(self.collective_rpc("dynrag_load", args=(str(load[0]), load[1], uri)))
            for load in _needed(requests)
        }
        if _hooks_only(requests):
            _answered(self.collective_rpc("dynrag_install"))
        for params, request in zip(_params_list(sampling_params), requests):
            if request is not None and request.detector is not None:
                _check_detector(params, request, kinds[(request.detector, DETECTOR)])
        outputs = generate(self, prompts, sampling_params, *args, **kwargs)
        results = _merged(self.collective_rpc("dynrag_results", args=([o.request_id for o in outputs],)))
        per_output = requests if len(requests) == len(outputs) else requests[:1] * len(outputs)
        for output, request in zip(outputs, per_output):
            if request is not None:
                _attach(output, request, results.get(output.request_id))
        return outputs

    return wrapper


# ---- online: AsyncLLM.generate (vllm serve) and the completion response ---------------------------------------------


def _online(generate):
    @functools.wraps(generate)
    async def wrapper(self, prompt, sampling_params, request_id, *args, **kwargs):
        request = _request(sampling_params)
        if request is not None:
            # what this engine loaded: (spec, role) -> (kind, trigger)
            kinds = self.__dict__.setdefault("_dynrag_kinds", {})
            uri = os.environ.get("MLFLOW_TRACKING_URI")
            for spec, role in request.loads():
                if (spec, role) not in kinds:
                    kinds[(spec, role)] = _kind_and_trigger(
                        await self.collective_rpc("dynrag_load", args=(str(spec), role, uri))
                    )
            if _hooks_only([request]) and not self.__dict__.get("_dynrag_installed"):
                _answered(await self.collective_rpc("dynrag_install"))
                self._dynrag_installed = True
            if request.detector is not None:
                _check_detector(sampling_params, request, kinds[(request.detector, DETECTOR)])
        async for output in generate(self, prompt, sampling_params, request_id, *args, **kwargs):
            if request is not None and output.finished:
                results = _merged(await self.collective_rpc("dynrag_results", args=([output.request_id],)))
                _attach(output, request, results.get(output.request_id))
            yield output

    return wrapper


def _completion_response(build):
    @functools.wraps(build)
    def wrapper(self, final_res_batch, *args, **kwargs):
        response = build(self, final_res_batch, *args, **kwargs)
        completions = [c for res in final_res_batch for c in res.outputs]
        for choice, completion in zip(response.choices, completions):
            result = getattr(completion, "dynrag", None)
            if result is not None:
                choice.dynrag = result
        return response

    return wrapper


# ---- the worker's side ----------------------------------------------------------------------------------------------


def _engine(worker):
    from detectors.serving.engine import EngineDetectors

    if getattr(worker, "_dynrag", None) is None:
        worker._dynrag = EngineDetectors(worker)
    return worker._dynrag


def _worker_load(self, spec: str, role: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """Load ``spec`` as a ``role`` (``detector`` or ``steering``) in this worker's engine: ``{"kind": ...,
    "trigger": ...}``, or ``{"error": one line}`` (an RPC answers; a failing load must not reach the engine's loop)."""
    try:
        loaded = _engine(self).load(Spec.parse(spec, role), role, tracking_uri)
    except Exception as err:  # every failure is the request's, never the engine's
        from detectors.errors import InputError

        message = " ".join(str(err).split())
        if not isinstance(err, InputError):
            log.exception("dynrag: loading %s failed", spec)
            message = f"{type(err).__name__}: {message}"
        return {"error": message}
    return {"kind": loaded.kind, "trigger": loaded.trigger}


def _worker_install(self) -> dict[str, Any]:
    """Hook this worker's engine for the requests that load no detector: ``{}``, or ``{"error": one line}``."""
    try:
        _engine(self).install()
    except Exception as err:  # every failure is the request's, never the engine's
        return {"error": " ".join(str(err).split())}
    return {}


def _worker_results(self, keys: list[str]) -> dict[str, dict]:
    engine = getattr(self, "_dynrag", None)
    return {} if engine is None else engine.results(list(keys))
