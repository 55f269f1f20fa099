"""The params sections of the comparison: ``score_baselines`` (with RetroRAG's evaluator) and ``evaluate``."""

from __future__ import annotations

import dataclasses

from detectors.config.core import check_fields, fail, positive

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "score_baselines": "ScoreBaselinesParams",
    "evaluate": "EvaluateParams",
}


@dataclasses.dataclass(frozen=True)
class EvaluatorParams:
    """RetroRAG's LLM-based evaluator: a yes/no prompt about the LLM's own answer (``{question}``, ``{answer}``)."""

    template: str
    chat: bool
    yes_words: list[str]
    no_words: list[str]

    def check(self, where: str) -> None:
        check_fields(f"{where}.template", self.template, ("question", "answer"))
        for key in ("yes_words", "no_words"):
            words = getattr(self, key)
            if not words or not all(isinstance(w, str) and w.strip() for w in words):
                fail(f"{where}.{key}", words, 'list at least one non-empty word, quoted in YAML ("yes", "no")')


@dataclasses.dataclass(frozen=True)
class ScoreBaselinesParams:
    evaluator: EvaluatorParams
    batch_size: int

    def check(self, where: str) -> None:
        positive(f"{where}.batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class EvaluateParams:
    ece_bins: int
    bootstrap: int  # bootstrap resamples for every interval
    seed: int
    experiment: str

    def check(self, where: str) -> None:
        positive(f"{where}.ece_bins", self.ece_bins)
        if not self.bootstrap >= 100:
            fail(
                f"{where}.bootstrap",
                self.bootstrap,
                "a 95% percentile interval needs at least 100 resamples (1000 recommended)",
            )
