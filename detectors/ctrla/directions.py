"""CtrlA feature directions (§3.2.1, App. C.1): statements, contrast pairs, per-layer PCA, the artifact.

Each statement is put after a positive and a negative instruction (Prompt 3.1: honest/dishonest,
confident/unconfident) in the LLM's chat format and run with teacher forcing. At every layer the
per-token differences of the statement's hidden states (positive minus negative) are collected; the
first principal component of those differences is the concept's direction at that layer, oriented
so that positive-instruction representations project higher.

The artifact is a directory: ``directions.safetensors`` (unit vectors ``[L, H]``, explained variance,
mean residual norm per layer, the directions refitted on fewer statements) and ``detector.json``
(kind, chosen layers, instructions, LLM fingerprint and the dtype they were extracted in). Loading it
against another LLM (or one running in another dtype), or a file whose layer count or width does not
match its fingerprint, is a clear error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from detectors.config.schema import ContrastParams
from detectors.ctrla.statements import StatementError, instruction_prefix, sample_statements, statement_ids
from detectors.errors import InputError
from detectors.llm.fingerprint import Fingerprint, LLMMismatchError, require_dtype
from detectors.llm.kv import batches, forward_rows, prefix_cache
from detectors.llm.layers import LayerTap
from detectors.llm.loading import LLM
from detectors.progress import progress
from detectors.registry.artifact import llm_section, read_config, read_llm_section, seal

log = logging.getLogger(__name__)

CONFIG = "detector.json"
TENSORS = "directions.safetensors"


class DirectionsError(InputError, ValueError):
    """A directions file is malformed or does not fit the LLM it is used with."""


# ---- extraction --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ContrastStats:
    """Per-layer contrast vectors of the statement tokens, grouped by statement."""

    diffs: torch.Tensor  # [L, N_tokens, H] positive minus negative, float32 on the LLM's device
    owner: np.ndarray  # [N_tokens] statement index of each token
    norms: torch.Tensor  # [L] mean residual-stream norm of the statement tokens (both instructions)


def contrast_differences(
    llm: LLM,
    params: ContrastParams,
    statements: list[str],
    batch_size: int,
    desc: str = "contrast",
    positive_context=None,
) -> ContrastStats:
    """Teacher-forced per-token differences of hidden states at every layer (CtrlA §3.2.1).

    ``positive_context`` (a callable returning a context manager) is entered around the positive runs
    only: tests plant a known direction that way (steering hooks on the positive pass).
    """
    n_layers = llm.fingerprint.num_layers
    pos, neg = (instruction_prefix(llm, text, params.chat) for text in (params.positive, params.negative))
    rows = statement_ids(llm, statements, params.statements.max_tokens, max(len(pos), len(neg)))
    plant = positive_context or contextlib.nullcontext
    with plant():
        kvs = {"pos": prefix_cache(llm, pos)}
    kvs["neg"] = prefix_cache(llm, neg)
    n_tokens, width = sum(len(r) for r in rows), llm.fingerprint.hidden_size
    # filled in place on the LLM's device, batch by batch: no host copy, no second [L, N, H] array from a stack
    diffs = torch.empty(n_layers, n_tokens, width, dtype=torch.float32, device=llm.device)
    owner = np.empty(n_tokens, dtype=np.int64)
    norm_sum, at = torch.zeros(n_layers, dtype=torch.float64, device=llm.device), 0
    with progress(total=len(rows), desc=desc, unit="stmt") as bar:
        for idx in batches(rows, batch_size):
            batch = [rows[i] for i in idx]
            states: dict[str, dict[int, torch.Tensor]] = {}
            for name, kv in kvs.items():
                captured: dict[int, torch.Tensor] = {}
                tap = LayerTap(
                    llm.model,
                    list(range(1, n_layers + 1)),
                    lambda layer, h: captured.__setitem__(layer, h.detach().float()),
                )
                with plant() if name == "pos" else contextlib.nullcontext(), tap:
                    forward_rows(llm, kv, batch)
                states[name] = captured
            for b, i in enumerate(idx):
                n = len(rows[i])
                owner[at : at + n] = i
                for layer in range(1, n_layers + 1):
                    p, q = states["pos"][layer][b, :n], states["neg"][layer][b, :n]
                    diffs[layer - 1, at : at + n] = p - q
                    norm_sum[layer - 1] += (p.norm(dim=-1).sum() + q.norm(dim=-1).sum()).double()
                at += n
            bar.update(len(idx))
    return ContrastStats(diffs=diffs, owner=owner, norms=(norm_sum.cpu() / max(2 * n_tokens, 1)).float())


def fit_pca(diffs: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """First principal component per layer of contrast vectors ``[L, N, H]``, oriented positive-up.

    As in RepE (which CtrlA builds on) each contrast vector gets a random sign before centring, so the
    component follows the positive-negative axis instead of being removed with the mean. Returns unit
    directions ``[L, H]`` and the explained-variance ratio of the first component ``[L]``.
    """
    if diffs.ndim != 3 or diffs.shape[1] < 2:
        raise StatementError(f"PCA needs at least 2 contrast vectors per layer, got shape {tuple(diffs.shape)}")
    gen = torch.Generator().manual_seed(seed)
    signs = (torch.randint(0, 2, (diffs.shape[1],), generator=gen).float() * 2 - 1).double().to(diffs.device)
    directions, explained = [], []
    for layer in diffs:  # one layer at a time, on the device the differences are on (float64: CPU and CUDA have it)
        x = layer.double() * signs[:, None]
        x = x - x.mean(0, keepdim=True)
        evals, evecs = torch.linalg.eigh(x.T @ x)  # covariance route: [H, H], cheaper than an SVD of [N, H]
        v = evecs[:, -1]
        if (layer.double() @ v).mean() < 0:  # positive minus negative should project above zero
            v = -v
        directions.append(v.float().cpu())
        total = float(evals.clamp_min(0).sum().cpu())
        explained.append(float(evals[-1]) / total if total > 0 else 0.0)
    return torch.stack(directions), torch.tensor(explained)


def size_curve(stats: ContrastStats, sizes: list[int], seed: int) -> dict[int, torch.Tensor]:
    """Directions refitted on the first ``n`` statements' contrast vectors, for each ``n`` in ``sizes``."""
    n_statements = int(stats.owner.max()) + 1
    out = {}
    for n in sorted(set(sizes)):
        if n >= n_statements:
            continue
        keep = torch.from_numpy(stats.owner < n).to(stats.diffs.device)
        out[n] = fit_pca(stats.diffs[:, keep], seed)[0]
    return out


# ---- the artifact ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Directions:
    """Per-layer unit directions of one concept, with the layers CtrlA uses them at and the LLM identity."""

    concept: str  # "honesty" | "confidence"
    vectors: torch.Tensor  # [L, H], row l-1 is layer l's direction (unit norm)
    explained_variance: torch.Tensor  # [L]
    norms: torch.Tensor  # [L] mean residual-stream norm (steering strength is relative to it)
    layers: list[int]  # 1-based layers used for steering (honesty) or monitoring (confidence)
    fingerprint: Fingerprint
    config: dict[str, Any]  # instructions, statements, steering/monitor params, llm location
    curve: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # n statements -> [L, H]

    def __post_init__(self) -> None:
        expected = (self.fingerprint.num_layers, self.fingerprint.hidden_size)
        if tuple(self.vectors.shape) != expected:
            raise DirectionsError(
                f"{self.concept} directions have shape {tuple(self.vectors.shape)} but their LLM "
                f"{self.fingerprint.name!r} has {expected[0]} layers of width {expected[1]}: the file is corrupt "
                "or was edited; rebuild it with `dvc repro extract_directions`"
            )
        bad = [layer for layer in self.layers if not 1 <= layer <= expected[0]]
        if bad or not self.layers:
            raise DirectionsError(f"{self.concept} directions: layers {self.layers} must be within 1..{expected[0]}")

    @property
    def dtype(self) -> str | None:
        """The dtype of the LLM the directions were extracted in (None: not recorded, an older artifact)."""
        return self.config.get("llm", {}).get("dtype")

    def require_llm(self, llm: LLM, allow_dtype_mismatch: bool = False) -> None:
        """Refuse an LLM other than the one the directions were extracted from, or one running in another
        dtype unless ``allow_dtype_mismatch`` (clear error saying what differs)."""
        if llm.fingerprint.num_layers != self.fingerprint.num_layers:
            raise LLMMismatchError(
                f"ctrla-{self.concept} directions have {self.fingerprint.num_layers} layers but the LLM "
                f"{llm.fingerprint.name!r} has {llm.fingerprint.num_layers}: extract directions for this LLM with `dvc "
                f"repro`"
            )
        self.fingerprint.require_same(llm.fingerprint, f"ctrla-{self.concept} directions")
        require_dtype(self.dtype, llm.dtype_name, f"ctrla-{self.concept} directions", allow_dtype_mismatch)

    def with_layers(self, layers: list[int], selection: str) -> Directions:
        """The same directions used at other ``layers``; ``config["layer_selection"]`` records how they were chosen
        (``selection``, e.g. "validation") and the layers extraction set (CtrlA's range scaled to the LLM)."""
        previous = self.config.get("layer_selection", {}).get("paper_layers", self.layers)
        config = {**self.config, "layer_selection": {"range": selection, "paper_layers": list(previous)}}
        return dataclasses.replace(self, layers=[int(x) for x in layers], config=config)

    def at(self, layers: list[int], device=None, dtype=None) -> torch.Tensor:
        """Direction rows of ``layers`` (1-based) as ``[len(layers), H]``."""
        return self.vectors[[layer - 1 for layer in layers]].to(device=device, dtype=dtype)

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {"vectors": self.vectors, "explained_variance": self.explained_variance, "norms": self.norms}
        tensors.update({f"curve.{n}": v for n, v in self.curve.items()})
        save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, directory / TENSORS)
        meta = {
            "kind": f"ctrla-{self.concept}",
            "concept": self.concept,
            "layers": self.layers,
            "llm": llm_section(self.fingerprint, self.config.get("llm", {})),
            "explained_variance": [round(float(x), 6) for x in self.explained_variance],
            **{k: v for k, v in self.config.items() if k != "llm"},
        }
        (directory / CONFIG).write_text(json.dumps(meta, indent=2))
        return seal(directory)

    @classmethod
    def load(cls, directory: str | Path) -> Directions:
        directory = Path(directory)
        for name in (CONFIG, TENSORS):
            if not (directory / name).exists():
                raise FileNotFoundError(
                    f"{directory} holds no {name}: not a CtrlA directions artifact (run extract_directions)"
                )
        meta = read_config(directory)  # its files verified first
        tensors = load_file(directory / TENSORS)
        missing = {"vectors", "explained_variance", "norms"} - set(tensors)
        if missing:
            raise DirectionsError(
                f"{directory / TENSORS} lacks {sorted(missing)}: rebuild it with `dvc repro extract_directions`"
            )
        fingerprint, llm_ref = read_llm_section(meta.get("llm", {}))
        config = {k: v for k, v in meta.items() if k not in ("kind", "concept", "layers", "llm", "explained_variance")}
        config["llm"] = llm_ref
        return cls(
            concept=meta["concept"],
            vectors=tensors["vectors"],
            explained_variance=tensors["explained_variance"],
            norms=tensors["norms"],
            layers=[int(x) for x in meta["layers"]],
            fingerprint=fingerprint,
            config=config,
            curve={int(k.split(".", 1)[1]): v for k, v in tensors.items() if k.startswith("curve.")},
        )


def extract(
    llm: LLM,
    concept: str,
    params: ContrastParams,
    statements: pd.DataFrame,
    layers: list[int],
    batch_size: int,
    seed: int,
    sizes: list[int],
    config: dict[str, Any],
) -> tuple[Directions, ContrastStats]:
    """Directions of ``concept`` from the ``train`` statements (up to ``statements.limit``); ``config["llm"]``
    (where the LLM came from) gets the dtype they are extracted in."""
    train = sample_statements(statements[statements["split"] == "train"], params.statements.limit, concept)
    if len(train) < 2:
        raise StatementError(
            f"{concept}: {len(train)} training statement(s); at least 2 are needed (check statements.source)"
        )
    stats = contrast_differences(llm, params, train["statement"].tolist(), batch_size, desc=f"extract {concept}")
    vectors, explained = fit_pca(stats.diffs, seed)
    directions = Directions(
        concept=concept,
        vectors=vectors,
        explained_variance=explained,
        norms=stats.norms,
        layers=layers,
        fingerprint=llm.fingerprint,
        config={
            **config,
            "llm": {**config.get("llm", {}), "dtype": llm.dtype_name},
            "n_statements": len(train),
            "n_tokens": int(stats.diffs.shape[1]),
        },
        curve=size_curve(stats, sizes, seed),
    )
    return directions, stats
