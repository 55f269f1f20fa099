"""CtrlA (§3.2): statements and Prompt 3.1 (:mod:`.statements`), honesty and confidence directions by
per-layer PCA (:mod:`.directions`), the layer ranges they are used at (:mod:`.layer_ranges`), honesty steering
Eq. 1 (:mod:`.steering`), the confidence monitor Eq. 2 with trigger, refusal detector and query masking
(:mod:`.monitor`), the registered detectors (:mod:`.registered`), the refusal handling in a RAG loop (:mod:`.refusal`),
and
the directions' quality incl. TruthfulQA under steering (:mod:`.quality`)."""

SCORE_COLUMN = "ctrla_confidence"  # the column of CtrlA's hallucination scores that evaluate_directions writes
# one score column per layer range: CtrlA's range scaled to the LLM's depth, and the window chosen on validation
RANGE_COLUMNS = {"paper": SCORE_COLUMN, "validation": f"{SCORE_COLUMN}[val-layers]"}
