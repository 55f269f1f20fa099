"""The first answer token's distribution as a hallucination score (before the answer is generated):
a low probability or a high entropy of the token the LLM is about to produce."""

from detectors.evaluation.scorers import ColumnScorer

FIRST_TOKEN_PROB = ColumnScorer("first_token_prob", "first_token_prob", higher_is_hallucinated=False)
FIRST_TOKEN_ENTROPY = ColumnScorer("first_token_entropy", "first_token_entropy")
