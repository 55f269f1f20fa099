"""The two interfaces every part shares.

- :class:`Detector` — a registered artifact (``dior-early``, ``dior-early-extended``, ``dior-realtime``,
  ``ctrla-honesty``, ``ctrla-confidence``, ``utility-<corpus>``): its kind, load/save, the fingerprint of the LLM it
  was built with, attaching (or loading) that LLM, and ``predict_frame``, the MLflow pyfunc view.
- :class:`Scorer` — anything that gives each unit of a :class:`Level` a hallucination score (higher =
  more likely hallucinated): trained detectors and training-free baselines alike. The comparison
  iterates scorers; a RAG loop wraps them as retrieval triggers.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import pandas as pd

from detectors.llm.fingerprint import Fingerprint, require_dtype
from detectors.llm.loading import LLM, load_recorded


@dataclasses.dataclass
class Watch:
    """A generation watched token by token by a detector that decides during it (:meth:`Detector.watch`): the
    generated ``tokens``, each one's ``score``, the first token that fires (None: none), the firing ``rule`` in words
    and what else the detector says of the generation (``extra``: DioR's keywords, CtrlA's refusal and query)."""

    tokens: list[str]
    scores: list[float]
    trigger: int | None
    rule: str
    extra: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Registration:
    """What registering a trained detector records beside its artifact (:meth:`Detector.registration`): ``features``,
    what a champion must share with a new version to be compared with it (None: any version); ``params``, logged with
    its run and kept in the model's metadata; ``val_key``, the ``info`` key of the validation AUROC the champion rule
    compares."""

    features: str | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    val_key: str = "best_val_auroc"


class Detector(abc.ABC):
    """A trained or extracted detector as stored in the registry.

    Subclasses set ``KIND`` and provide ``fingerprint`` (the LLM it was built with), ``llm_ref`` (where
    that LLM came from and the dtype its features were computed in: ``{"dir", "source", "gguf_file",
    "dtype"}``) and an ``llm`` attribute (None until attached).
    """

    KIND: ClassVar[str]
    # when it decides retrieval: "question" (before generating, from the question: `dynrag assess`), "generation"
    # (token by token while the LLM generates: `dynrag monitor`), None (it does not decide retrieval: a steering)
    DECIDES: ClassVar[str | None] = None
    # the trigger the RAG loop builds around it (a name of detectors.extensions.DETECTOR_TRIGGERS); None for a kind
    # that decides no retrieval. A kind that declares one is a trigger kind
    TRIGGER: ClassVar[str | None] = None
    # what :meth:`watch` needs besides the text (name -> why), for a caller to ask before loading the LLM
    WATCH_NEEDS: ClassVar[dict[str, str]] = {}
    fingerprint: Fingerprint
    llm_ref: dict[str, Any]
    llm: LLM | None

    @classmethod
    @abc.abstractmethod
    def load(cls, directory: str | Path) -> Detector:
        """The detector stored in ``directory`` (written by :meth:`save`)."""

    @abc.abstractmethod
    def save(self, directory: str | Path) -> Path:
        """Write the artifact (``detector.json`` naming ``KIND``, tensors as safetensors, never pickle)."""

    @abc.abstractmethod
    def predict_frame(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The MLflow pyfunc view: one row of outputs per input row."""

    @property
    def feature_dtype(self) -> str | None:
        """The dtype of the LLM the detector's features were computed in (None: not recorded, an older artifact)."""
        return self.llm_ref.get("dtype")

    def check_llm(self, llm: LLM, allow_dtype_mismatch: bool = False) -> None:
        """Refuse an LLM other than the one the detector was built with, or one running in another dtype
        unless ``allow_dtype_mismatch`` (an error saying what differs)."""
        what = f"detector {self.KIND!r}"
        self.fingerprint.require_same(llm.fingerprint, what)
        require_dtype(self.feature_dtype, llm.dtype_name, what, allow_dtype_mismatch)

    def attach(self, llm: LLM, allow_dtype_mismatch: bool = False) -> Detector:
        """Use ``llm`` (already in memory) from now on; it must be the detector's LLM, in the dtype its
        features were computed in unless ``allow_dtype_mismatch``."""
        self.check_llm(llm, allow_dtype_mismatch)
        self.llm = llm
        return self

    def load_llm(
        self,
        dtype: str | None = None,
        device: str = "auto",
        *,
        root: str | Path | None = None,
        allow_dtype_mismatch: bool = False,
    ) -> LLM:
        """Load the LLM from where the artifact says it came from (relative locations against ``root``, default
        the working directory), in the recorded feature dtype unless ``dtype`` is given, and attach it."""
        llm = load_recorded(self.llm_ref, f"detector {self.KIND!r}", dtype, device, root, self.fingerprint)
        self.attach(llm, allow_dtype_mismatch)
        return self.llm

    def require_llm(self) -> LLM:
        """The attached LLM, loaded first if none is attached."""
        return self.llm if self.llm is not None else self.load_llm()

    def watch(self, text: str, max_new_tokens: int | None = None, **needs: Any) -> Watch:
        """A detector that decides during generation (``DECIDES == "generation"``): generate from ``text`` with it
        attached and say where it fires; ``needs`` gives what :data:`WATCH_NEEDS` names."""
        raise NotImplementedError(f"a {self.KIND!r} detector does not watch a generation (DECIDES={self.DECIDES!r})")

    def registration(self) -> Registration:
        """What the register stage records of this detector beside its artifact (a trained kind says what sets its
        versions apart: its feature set, its layers, its corpus)."""
        return Registration()


class Level(str, enum.Enum):
    """The unit a score is given to."""

    QUESTION = "question"  # a question, before any answer token (early detection)
    TOKEN = "token"  # one generated token (an entity's token in the real-time set)
    ENTITY = "entity"  # one entity of a continuation, from its tokens
    CONTINUATION = "continuation"  # a whole continuation (DioR's "sentence level"; the key in metrics files)

    @classmethod
    def _missing_(cls, value: object) -> Level | None:
        """``"sentence"``, the continuation level's name in metrics files and MLflow tags written before it was
        renamed, still reads as :attr:`CONTINUATION`."""
        return cls.CONTINUATION if value == "sentence" else None


@runtime_checkable
class Scorer(Protocol):
    """A hallucination score per unit of ``level``; the comparison treats every scorer the same way."""

    name: str
    kind: str  # "detector" | "trained baseline" (fitted by the comparison, e.g. a probe) | "baseline" (training-free)
    level: Level
    is_probability: bool  # False: the evaluation maps scores to probabilities by a Platt fit on validation
    threshold: float | None  # its own decision threshold; None: chosen on validation by the evaluation
    features: str  # what the score is computed from, for the MLflow run

    def score(self, units: pd.DataFrame) -> np.ndarray:
        """One score per row of ``units`` (the level's unit table, see :mod:`detectors.evaluation.units`)."""
        ...
