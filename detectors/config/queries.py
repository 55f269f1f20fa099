"""The settings types of the query formulations that have settings of their own (``rag_eval.query_settings.<name>``,
declared by their :class:`~detectors.rag.queries.QueryEntry`): DRAGIN's QFS and DioR's importance-scored query. Apart
from :mod:`.rag`, which checks the entries' names, so that :mod:`detectors.rag.queries` imports its types without a
cycle through the registries."""

from __future__ import annotations

import dataclasses

from detectors.config.core import fail, positive


@dataclasses.dataclass(frozen=True)
class QfsParams:
    """DRAGIN's QFS (§3.2): the ``top_n`` tokens the flagged token attends to most are kept in the query."""

    top_n: int

    def check(self, where: str) -> None:
        positive(f"{where}.top_n", self.top_n)


@dataclasses.dataclass(frozen=True)
class DiorWeightsParams:
    """DioR §3.3.1: weights of the attention, TF-IDF, relative position and question-similarity terms."""

    attention: float
    tfidf: float
    position: float
    similarity: float

    def check(self, where: str) -> None:
        values = dataclasses.asdict(self)
        for name, value in values.items():
            if not value >= 0:
                fail(f"{where}.{name}", value, "weights must be >= 0")
        if not sum(values.values()) > 0:
            fail(where, values, "at least one weight must be positive")


@dataclasses.dataclass(frozen=True)
class DiorQueryParams:
    """DioR's pre-retrieval query (§3.3.1): the ``top`` keywords by the importance score of these ``weights``."""

    top: int
    weights: DiorWeightsParams

    def check(self, where: str) -> None:
        positive(f"{where}.top", self.top)
