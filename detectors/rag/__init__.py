"""A small dynamic RAG package over any causal LM: a retriever interface with a bm25s index, retrieval triggers
from registered detectors or training-free scores, query formulations, and the generation loop.

    from detectors.rag.retriever import BM25Retriever
    from detectors.rag.loop import RagConfig, RagLoop
    from detectors.rag.triggers import make_trigger

Modules: ``corpus`` (passages), ``retriever`` (``Retriever``, ``BM25Retriever``), ``triggers`` (when to retrieve),
``queries`` (what to retrieve), ``context`` (DioR's post-retrieval: stepwise selection, chunking, the passages
block), ``loop`` (the loop, KV-cache reuse, the threshold sweep), ``metrics``, ``sweep``, ``report``.
"""
