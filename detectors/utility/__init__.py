"""Retrieval utility: does retrieving for a question buy a better answer? Labels from answering with and without
passages (:mod:`detectors.utility.labels`) and the trained trigger that learns the decision itself, with its
post-retrieval gate (:mod:`detectors.utility.detector`). The RAG loop that records the labels is
:mod:`detectors.rag.recording` (the loop imports the gate, so the package sits below ``rag``)."""
