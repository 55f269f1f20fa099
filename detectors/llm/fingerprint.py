"""The identity of an LLM's weights, recorded in every artifact built from it, and the error when they differ;
the dtype its features were computed in, and the error when an artifact is served in another one."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import warnings
from typing import Any

import torch
from transformers import PreTrainedModel

from detectors.errors import InputError

log = logging.getLogger(__name__)

_DIGEST_SAMPLES = 4096


class LLMMismatchError(InputError, RuntimeError):
    """An artifact was made with a different LLM than the one it is used with."""


class DtypeMismatchError(LLMMismatchError):
    """An artifact's features were computed in another dtype than the LLM it is used with computes them in."""


def require_dtype(recorded: str | None, given: str, what: str, allow_dtype_mismatch: bool = False) -> None:
    """Refuse to serve ``what`` (whose features were computed in ``recorded``) with an LLM that runs in ``given``.

    The fingerprint rounds weights to bfloat16 on purpose, so it cannot tell fp32 from bf16 features; this
    check does. ``recorded`` None is an artifact made before dtypes were recorded: served with a warning.
    """
    if recorded is None:
        warnings.warn(
            f"{what} records no feature dtype (it was built before dtypes were recorded); it is served with {given} "
            "features, which may differ from those it was built from. Rebuild it with `dvc repro` to record the dtype.",
            stacklevel=3,
        )
    elif recorded != given:
        if not allow_dtype_mismatch:
            raise DtypeMismatchError(
                f"{what}: built from {recorded} features, but the LLM given computes {given} features, which shifts "
                f"its scores. Load the LLM with dtype={recorded!r} (the detector's `load_llm()` does by default), or "
                f"pass "
                "allow_dtype_mismatch=True to accept the difference."
            )
        log.warning("%s: serving %s features to a detector built from %s features (allowed)", what, given, recorded)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Identity of an LLM's weights, recorded in every artifact built from it."""

    name: str
    weights_digest: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    @classmethod
    def of(cls, model: PreTrainedModel, name: str) -> Fingerprint:
        cfg = model.config.get_text_config()
        return cls(
            name=name,
            weights_digest=weights_digest(model),
            hidden_size=int(cfg.hidden_size),
            num_layers=int(cfg.num_hidden_layers),
            vocab_size=int(cfg.vocab_size),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

    def differences(self, other: Fingerprint) -> dict[str, tuple[Any, Any]]:
        """The identity fields (not the name) in which ``other`` differs: ``{field: (this, other)}``."""
        keys = ("weights_digest", "hidden_size", "num_layers", "vocab_size")
        return {k: (getattr(self, k), getattr(other, k)) for k in keys if getattr(self, k) != getattr(other, k)}

    def require_same(self, other: Fingerprint, what: str) -> None:
        """Raise if ``other`` (the LLM in hand) is not the LLM that ``what`` was built with."""
        diff = self.differences(other)
        if diff:
            details = ", ".join(f"{k}: built with {a!r}, given {b!r}" for k, (a, b) in diff.items())
            raise LLMMismatchError(
                f"{what} was built with LLM {self.name!r} but is used with {other.name!r} ({details}). "
                f"Load the LLM it was trained on, or rebuild {what} for this LLM with `dvc repro`."
            )


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, shape and a strided sample of its values.

    Values are rounded to bfloat16 first so the same weights loaded in fp32, bf16 or fp16 agree;
    sampling keeps this cheap for 7B models while any real change of weights changes the digest.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _DIGEST_SAMPLES)
        sample = flat[::step][:_DIGEST_SAMPLES].to(torch.float32).to(torch.bfloat16).view(torch.int16)
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(sample.cpu().numpy().tobytes())
    return h.hexdigest()[:16]
