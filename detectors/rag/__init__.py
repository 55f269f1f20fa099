"""A small dynamic RAG package over any causal LM: a retriever interface with a bm25s index, retrieval triggers
from registered detectors or training-free scores, query formulations, and the generation loop, which answers many
questions at once.

    from detectors.rag.retriever import BM25Retriever
    from detectors.rag.loop import RagConfig, RagLoop
    from detectors.rag.extensions import make_query
    from detectors.rag.kinds import make_trigger

Modules: ``corpus`` (passages), ``retriever`` (``Retriever``, ``BM25Retriever``), ``stats`` (what the loop measures
while the LLM generates, under the stored sets' names), ``triggers`` (a scorer, a threshold and a policy: when to
retrieve), ``kinds`` (one module per trigger family, with the calculators of what it reads; ``make_trigger``), ``queries`` (what to retrieve), ``context`` (DioR's post-retrieval:
stepwise selection, chunking, the passages block), ``loop`` (the batched loop, the threshold sweep's trace),
``answer_metrics``, ``sweep``, ``report``; ``retroactive`` (RetroRAG, a loop of its own). ``extensions`` and
``frameworks`` name what a configuration can use (the triggers, the query formulations, the frameworks with a loop of
their own): registries of names, read by the params' validation without importing the implementations.
"""
