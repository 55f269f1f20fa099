"""Evaluation: metrics (:mod:`.metrics`), the units each level scores (:mod:`.units`), scorer building
blocks (:mod:`.scorers`) and the comparison of scorers on one level (:mod:`.compare`); and the RAG loop's evaluation:
the answers' metrics (:mod:`.answer_metrics`), the threshold sweep (:mod:`.rag_sweep`) and its report
(:mod:`.rag_report`). Evaluation imports no paper package: each detector package imports it, never the reverse."""
