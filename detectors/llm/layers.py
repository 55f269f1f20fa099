"""Where an LLM's layers are, and the two ways of numbering them.

- a **block** is a decoder block numbered 1..L; its output is the residual stream after block l
  (CtrlA's steering and monitoring layers, forward hooks);
- a **hidden-state index** is a position in transformers' ``hidden_states`` tuple, 0..L: 0 is the
  embedding output, l < L is block l's output, and L is the output of the final norm (DioR's
  captured layers; what ``output_hidden_states`` returns).

Params name layers as block numbers 1..L or negative counts from the last (-1 = the last);
:func:`hidden_state_indices` maps them to hidden-state indices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (transformers' ``get_decoder()``; ``.model`` where there is none, as in vLLM's
    models), holding ``.layers`` and the final ``.norm``."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer blocks whose outputs are the residual stream after layer 1..L."""
    layers = getattr(decoder(model), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder .layers: layer hooks (real-time capture, CtrlA) need a "
            f"decoder-only LLM"
        )
    return layers


def layer_output(output: Any) -> torch.Tensor:
    """The hidden states in a decoder block's output (a tensor, or a tuple starting with one)."""
    return output[0] if isinstance(output, tuple) else output


def hidden_state_indices(layers: list[int], num_layers: int, key: str) -> list[int]:
    """``hidden_states`` indices of layers named 1..L or -1..-L (``key`` names the setting in errors)."""
    out = []
    for layer in layers:
        if not (-num_layers <= layer <= num_layers) or layer == 0:
            raise ValueError(
                f"{key} has {layer}, but the LLM has {num_layers} layers: use 1..{num_layers} or -1..-{num_layers}"
            )
        out.append(layer if layer > 0 else num_layers + 1 + layer)
    return out


def state_modules(model: torch.nn.Module, indices: list[int]) -> list[torch.nn.Module]:
    """The module whose output is ``hidden_states[i]`` for each index i in 1..L (L is the final norm)."""
    blocks = decoder_layers(model)
    return [decoder(model).norm if i == len(blocks) else blocks[i - 1] for i in indices]


class LayerTap:
    """Forward hooks on decoder blocks (1-based numbers) passing each output to ``fn(block, hidden)``.

    Removed on exit, also when the forward pass raises. Runs after steering hooks (those are prepended),
    so it sees the representations the LLM actually continues from.
    """

    def __init__(self, model: torch.nn.Module, blocks: list[int], fn: Callable[[int, torch.Tensor], Any]):
        self.model, self.blocks, self.fn, self.handles = model, list(blocks), fn, []

    def __enter__(self) -> LayerTap:
        modules = decoder_layers(self.model)
        for block in self.blocks:
            self.handles.append(
                modules[block - 1].register_forward_hook(
                    lambda m, a, out, block=block: self.fn(block, layer_output(out))
                )
            )
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class StateTap:
    """Forward hooks catching ``hidden_states[i]`` for each index of ``indices`` at every position of every pass
    (see :func:`state_modules`); ``take()`` gives the last pass's ``[B, T, len(indices) * H]`` in ``dtype`` (float16,
    as the real-time set stores them) and forgets it. The generation recorder and the RAG loop's real-time probe
    capture hidden states with it."""

    def __init__(self, model: torch.nn.Module, indices: list[int], dtype: torch.dtype = torch.float16):
        self.model, self.indices, self.dtype = model, list(indices), dtype
        self.handles: list = []
        self._caught: dict[int, torch.Tensor] = {}

    def __enter__(self) -> StateTap:
        for i, module in enumerate(state_modules(self.model, self.indices)):
            self.handles.append(
                module.register_forward_hook(
                    lambda m, a, out, i=i: self._caught.__setitem__(i, layer_output(out).detach())
                )
            )
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @property
    def caught(self) -> bool:
        """Whether a pass ran since the last ``take``."""
        return len(self._caught) == len(self.indices)

    def take(self) -> torch.Tensor:
        if not self.caught:
            raise RuntimeError("the state tap caught no pass: run the LLM inside `with tap:`")
        out = torch.cat([self._caught[i] for i in range(len(self.indices))], dim=-1).to(self.dtype)
        self._caught = {}
        return out


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str = "eager") -> Iterator[None]:
    """Run the model with attention implementation ``name`` inside the block; the previous one is restored
    on exit, also when the block raises."""
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous != name:
            model.set_attn_implementation(previous)
