"""The params sections of the early-detection set: the QA source, ``build_early``, ``train_early``."""

from __future__ import annotations

import dataclasses

from detectors.config.common import check_model_name, check_sampled_source
from detectors.config.core import check_share, fail, positive
from detectors.config.schema import EarlyFeatureParams, TrainingParams, check_feature_groups

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "qa": "QAParams",
    "build_early": "BuildEarlyParams",
    "train_early": "TrainEarlyParams",
}


@dataclasses.dataclass(frozen=True)
class QAParams:
    """The question-answering source and its deterministic split."""

    source: str
    question_field: str | None
    answers_field: str | None
    id_field: str | None
    limit: int | None
    splits: dict[str, float]

    def check(self, where: str) -> None:
        check_sampled_source(
            where,
            self.source,
            self.limit,
            self.splits,
            "name bigbench:<task>, a .json/.jsonl/.csv/.parquet file or hf:<dataset id>",
        )


@dataclasses.dataclass(frozen=True)
class BuildEarlyParams:
    """``answer_hidden_layers``: the layers whose hidden state of every answer token is kept while the answers are
    decoded (the real-time detector's ``answers`` candidate reads them beside the same token's probability and
    entropy, so they are ``build_realtime.hidden_layers``)."""

    features: EarlyFeatureParams
    max_new_tokens: int
    stop: list[str]
    answer_hidden_layers: list[int]
    shard_size: int
    max_failed_share: float

    def check(self, where: str) -> None:
        if not self.answer_hidden_layers:
            fail(
                f"{where}.answer_hidden_layers",
                self.answer_hidden_layers,
                "name at least one layer, e.g. build_realtime.hidden_layers",
            )
        positive(f"{where}.max_new_tokens", self.max_new_tokens)
        positive(f"{where}.shard_size", self.shard_size)
        check_share(f"{where}.max_failed_share", self.max_failed_share)
        for i, stop in enumerate(self.stop):
            if not stop:
                fail(f"{where}.stop[{i}]", stop, "stop strings must be non-empty (use [] for no stop string)")


@dataclasses.dataclass(frozen=True)
class TrainEarlyParams:
    """``detectors``: name → feature groups of each early detector trained and written to ``paths.early_model/<name>/``;
    ``ablation``: extra feature sets trained beside them, each named ``gru[<groups joined by +>]``."""

    detectors: dict[str, list[str]]
    ablation: list[list[str]]
    training: TrainingParams

    def check(self, where: str) -> None:
        if not self.detectors:
            fail(
                f"{where}.detectors",
                self.detectors,
                "name at least one detector, e.g. {dior-early: [attribution, entropy]}",
            )
        for name in self.detectors:
            check_model_name(f"{where}.detectors", name)
        keyed = [(f"{where}.detectors.{name}", feats) for name, feats in self.detectors.items()]
        keyed += [(f"{where}.ablation[{i}]", feats) for i, feats in enumerate(self.ablation)]
        seen: dict[
            frozenset, str
        ] = {}  # feature groups -> the key that trains them (group order does not change a detector)
        for key, feats in keyed:
            check_feature_groups(key, feats)
            if frozenset(feats) in seen:
                fail(key, feats, f"the same feature groups as {seen[frozenset(feats)]}, trained already: remove one")
            seen[frozenset(feats)] = key
