"""A Stitch in Time (Varshney et al. 2023): §2.1.2's concept-level logit uncertainty from the probabilities of an
entity's tokens — their minimum (MIN), mean (AVG) or normalised product (NORM); a continuation scores its most
uncertain entity — and the validation of an uncertain concept (§2.1.3-2.1.5, :class:`SitValidator`), which the RAG
loop runs for the ``sit`` trigger before it repairs the sentence (§2.2)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from detectors.evaluation.scorers import TokenStatScorer
from detectors.interfaces import Level
from detectors.llm.judge import yes_no_ids, yes_probability


@dataclasses.dataclass(frozen=True)
class _StitchInTime(TokenStatScorer):
    """An entity's score from its tokens' probabilities; defined for entities and continuations."""

    stat: str = "prob"
    levels: tuple[Level, ...] = (Level.ENTITY, Level.CONTINUATION)


@dataclasses.dataclass(frozen=True)
class SitMin(_StitchInTime):
    name: str = "sit_min"

    def entity(self, values: np.ndarray) -> float:
        return float(1 - values.min())


@dataclasses.dataclass(frozen=True)
class SitAvg(_StitchInTime):
    name: str = "sit_avg"

    def entity(self, values: np.ndarray) -> float:
        return float(1 - values.mean())


@dataclasses.dataclass(frozen=True)
class SitNorm(_StitchInTime):
    name: str = "sit_norm"

    def entity(self, values: np.ndarray) -> float:
        return float(1 - np.exp(np.log(np.clip(values, 1e-12, None)).mean()))


# ---- Stitch-in-Time's validation (§2.1.3-2.1.5), run by the RAG loop for the ``sit`` trigger ------------------------


@dataclasses.dataclass
class SitValidator:
    """Validates an uncertain concept of a generated sentence (§2.1.3-2.1.5): a yes/no validation question about the
    concept (``params.validation_question``: ``{question}``, ``{sentence}``, ``{concept}``) is the retrieval query, and
    the LLM answers it from the passages (``params.prompt``: ``{passages}``, ``{validation_question}``, Table 3's
    "Answer the below question ... in Yes or No based on the above context"). :meth:`judge` gives P(yes) / (P(yes) +
    P(no)) of its next token; the concept passes at or above ``params.threshold``.

    Adaptation at this scale: the paper instructs the LLM to write the validation question (Table 3), which a 135M
    model cannot do reliably; the template is the question-generation tool the paper also studies (§2.1.3)."""

    llm: Any
    params: Any  # detectors.config.rag.SitParams
    batch_size: int = 16

    def __post_init__(self) -> None:
        self.yes_ids, self.no_ids = yes_no_ids(self.llm.tokenizer, self.params.yes_words, self.params.no_words)

    @property
    def threshold(self) -> float:
        return self.params.threshold

    def question(self, question: str, sentence: str, concept: str) -> str:
        """The validation question of ``concept`` in ``sentence`` (the answer to ``question``): the retrieval query."""
        return self.params.validation_question.format(
            question=question.strip(), sentence=sentence.strip(), concept=concept.strip()
        )

    def judge(self, validation_questions: list[str], passages: list[str], on_batch=None) -> np.ndarray:
        """P(yes) of each validation question answered from its rendered passages (``on_batch``: see
        :func:`~detectors.llm.judge.yes_probability`)."""
        prompts = [
            self.params.prompt.format(passages=p, validation_question=q) for q, p in zip(validation_questions, passages)
        ]
        return yes_probability(
            self.llm, prompts, self.yes_ids, self.no_ids, batch_size=self.batch_size, on_batch=on_batch
        )
