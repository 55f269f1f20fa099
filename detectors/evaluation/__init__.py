"""Evaluation: metrics (:mod:`.metrics`), the units each level scores (:mod:`.units`), scorer building
blocks (:mod:`.scorers`) and the comparison of scorers on one level (:mod:`.compare`)."""
