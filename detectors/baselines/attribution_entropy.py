"""DioR Eq. 1 alone: the entropy of the IG attribution over the question's tokens (a spread-out
attribution is taken as a sign that the LLM does not know what to focus on)."""

from detectors.evaluation.scorers import ColumnScorer

ATTRIBUTION_ENTROPY = ColumnScorer("attribution_entropy", "entropy")
