"""A small dynamic RAG package over any causal LM: a retriever interface with a bm25s index, retrieval triggers
from registered detectors or training-free scores, query formulations, and the generation loop, which answers many
questions at once.

    from detectors.rag.retriever import BM25Retriever
    from detectors.rag.loop import RagConfig, RagLoop
    from detectors.rag.families import make_query, make_trigger

Modules: ``corpus`` (passages and their sources), ``retriever`` (``Retriever``, ``open_index``, ``BM25Retriever``),
``bm25_build`` (the streaming index build), ``bm25_search`` (the top-k kernel), ``stats`` (what the loop measures
while the LLM generates, under the stored sets' names), ``triggers`` (a scorer, a threshold and a policy: when to
retrieve), ``families`` (one module per trigger family, with the calculators of what it reads; ``make_trigger``),
``queries`` (what to retrieve), ``context`` (DioR's post-retrieval:
stepwise selection, chunking, the passages block), ``loop`` (the batched loop, the threshold sweep's trace),
``recording`` (the loop that labels retrieval utility); ``retroactive`` (RetroRAG, a loop of its own). Scoring the
answers, the threshold sweep and the report are evaluation: :mod:`detectors.evaluation.answer_metrics`,
:mod:`detectors.evaluation.rag_sweep`, :mod:`detectors.evaluation.rag_report`. What a
configuration can name (the triggers, the query formulations, the frameworks) is registered in
:mod:`detectors.extensions`, below every package, so the params' validation reads the names without the code.
"""
