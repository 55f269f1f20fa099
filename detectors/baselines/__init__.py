"""Training-free hallucination scores, one small module each, behind :class:`detectors.interfaces.Scorer`.

Question level: attribution entropy (DioR Eq. 1), first-token probability and entropy, a logistic-
regression probe, RetroRAG's evaluator: Eq. 1's self-consistency with a sampled answer (``retrorag_self_consistency``)
and
asked about the LLM's own answer (``retrorag_self_evaluation``); real-time levels: FLARE, Stitch-in-Time
MIN/AVG/NORM, token entropy, DRAGIN's RIND; both: CtrlA's confidence monitor (one scorer per
``ctrla_confidence*`` column or per-token stat).

:mod:`detectors.baselines.catalog` lists them (:func:`~detectors.baselines.catalog.question_baselines`,
:func:`~detectors.baselines.catalog.realtime_baselines`). The package imports none of its modules, so using one scorer
(the RAG loop's FLARE trigger) loads only that one.
"""
