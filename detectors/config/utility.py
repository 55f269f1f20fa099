"""The params sections of the retrieval-utility trigger: ``build_utility``, ``train_utility``."""

from __future__ import annotations

import dataclasses

from detectors.config.common import check_model_name
from detectors.config.core import check_share, fail, positive
from detectors.config.schema import TrainingParams

# the params.yaml sections these types validate (detectors.config.sections reads this literal, never imports it)
SECTION_TYPES = {
    "build_utility": "BuildUtilityParams",
    "train_utility": "TrainUtilityParams",
}


@dataclasses.dataclass(frozen=True)
class BuildUtilityParams:
    """Retrieval-utility labels: every QA question answered without and with the passages of each corpus."""

    corpora: list[str]  # index_corpus corpora (paths.rag_index/<corpus>); [] trains no utility trigger
    batch_size: int  # questions the RAG loop answers together
    shard_size: int  # questions per resumable shard
    max_failed_share: float

    def check(self, where: str) -> None:
        if len(set(self.corpora)) != len(self.corpora):
            fail(
                f"{where}.corpora",
                self.corpora,
                "name each corpus of index_corpus.corpora once, e.g. [wiki, facts] ([]: no utility trigger)",
            )
        for i, corpus in enumerate(self.corpora):
            check_model_name(f"{where}.corpora[{i}]", corpus)
        positive(f"{where}.batch_size", self.batch_size)
        positive(f"{where}.shard_size", self.shard_size)
        check_share(f"{where}.max_failed_share", self.max_failed_share)


# per-question early columns (the GRU's attribution sequence is not read)
UTILITY_PRE_GROUPS = (
    "entropy",
    "first_token",
    "hidden",
)


@dataclasses.dataclass(frozen=True)
class TrainUtilityParams:
    """The utility trigger of each corpus (``utility-<corpus>``): its retrieval decision reads ``pre_features`` of the
    early set; ``budget``: the retrieval rate of its budget operating point."""

    pre_features: list[str]
    budget: float
    training: TrainingParams

    def check(self, where: str) -> None:
        if (
            not self.pre_features
            or any(g not in UTILITY_PRE_GROUPS for g in self.pre_features)
            or len(set(self.pre_features)) != len(self.pre_features)
        ):
            fail(f"{where}.pre_features", self.pre_features, f"list some of {list(UTILITY_PRE_GROUPS)} once each")
        if not 0 < self.budget <= 1:
            fail(f"{where}.budget", self.budget, "a retrieval rate in (0, 1], e.g. 0.6")
