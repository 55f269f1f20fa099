"""The registered detectors inside a serving engine: vLLM (``docs/serving.md``).

- :mod:`detectors.serving.requests` what a request asks for (``SamplingParams.extra_args``, ``vllm_xargs`` over HTTP)
  and what it gets back; no vLLM import, so it is read and tested anywhere.
- :mod:`detectors.serving.engine` the engine side: hooks in vLLM's model runner that capture each detector's served
  features in the batch, score them with the detector's own functions, steer and stop the requests that ask.
- :mod:`detectors.serving.vllm_plugin` the plugin vLLM loads (entry point ``vllm.general_plugins``): it loads the
  detectors in the engine, and returns the scores with each request's output, offline and over HTTP.
"""
