"""CtrlA honesty steering (Eq. 1): add ``λ·v_l`` to the residual stream after each chosen block, at every token."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from detectors.ctrla.directions import Directions
from detectors.llm.layers import decoder_layers, layer_output


def steering_vectors(directions: Directions, lam: float, layers: list[int], relative: bool) -> dict[int, torch.Tensor]:
    """The vector added at each layer: ``lam * v_l``, times the layer's mean residual norm when ``relative``."""
    return {
        layer: lam * (float(directions.norms[layer - 1]) if relative else 1.0) * directions.vectors[layer - 1].float()
        for layer in layers
    }


@contextlib.contextmanager
def steer(model: torch.nn.Module, vectors: dict[int, torch.Tensor]) -> Iterator[dict[int, torch.Tensor]]:
    """Add ``vectors[l]`` to the residual stream after layer ``l`` (1-based) at every token, inside the block.

    The hooks are prepended, so hidden-state capture (transformers' own or a monitor's) sees the
    steered stream; they are removed on exit, also when generation raises.
    """
    blocks = decoder_layers(model)
    handles = []

    def hook(vector: torch.Tensor):
        cast: dict[tuple, torch.Tensor] = {}  # the vector on the stream's device and dtype, made once (not per pass)

        def add(module, args, output):
            h = layer_output(output)
            key = (h.device, h.dtype)
            if key not in cast:
                cast[key] = vector.to(device=h.device, dtype=h.dtype)
            h = h + cast[key]
            return (h, *output[1:]) if isinstance(output, tuple) else h

        return add

    try:
        for layer, vector in vectors.items():
            if not 1 <= layer <= len(blocks):
                raise ValueError(f"steering layer {layer} is outside 1..{len(blocks)} of this LLM")
            handles.append(blocks[layer - 1].register_forward_hook(hook(vector), prepend=True))
        yield vectors
    finally:
        for handle in handles:
            handle.remove()
