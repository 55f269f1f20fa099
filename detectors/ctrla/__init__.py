"""CtrlA (§3.2): statements and Prompt 3.1 (:mod:`.statements`), honesty and confidence directions by
per-layer PCA (:mod:`.directions`), honesty steering Eq. 1 (:mod:`.steering`), the confidence monitor
Eq. 2 with trigger, refusal detector and query masking (:mod:`.monitor`), the registered detectors
(:mod:`.detectors`), and their evaluation incl. TruthfulQA under steering (:mod:`.evaluation`)."""

SCORE_COLUMN = "ctrla_confidence"  # the column of CtrlA's hallucination scores that evaluate_directions writes
