"""The seed systems that answer with a loop of their own (``rag_eval.frameworks``; each one's params are the
``params.yaml`` section of its name), by name: a lazy registry (:mod:`detectors.lazy`) of classes built as
``Class(llm, retriever, params, prompt, batch_size)`` with ``answer_all(questions, records)``.

A module of its own, names only: the stages that run the RAG loop's triggers (build_utility) do not depend on the
frameworks' code, and validating ``params.yaml`` reads the names without importing any framework.
"""

from __future__ import annotations

from detectors.lazy import LazyRegistry

FRAMEWORKS = LazyRegistry("framework", {"retrorag": "detectors.rag.retroactive:RetroRag"})
