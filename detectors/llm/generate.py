"""Batched generation for the LLM's own instruction calls (RetroRAG's generators and SC-generator, CtrlA's query
rewrite):
prompts in batches of similar length, each continuing its longest cached prefix (:mod:`detectors.llm.prefill`), decoded
in lockstep, greedy or sampled from one seeded random stream per row, so that a row's continuation never depends on the
rows beside it or on the batch size."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from detectors.llm.decoder import Decoder, Row
from detectors.llm.kv import batches
from detectors.llm.prefill import KVCache, prefill

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

OnBatch = Callable[[list[int], int, float], None]  # (row indices, forward calls, seconds) of one batched call


def instruction_prompt(llm: LLM, content: str, chat: bool) -> str:
    """An instruction as the LLM reads it: with ``chat`` a user turn followed by the assistant's header."""
    if not chat:
        return content
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


@dataclasses.dataclass
class Generation:
    """One continuation: its tokens (up to the end of sequence, excluded, or the token completing a stop string,
    included) and their text, cut before the first stop string and stripped."""

    ids: list[int]
    text: str


def row_generator(seed: int, text: str, step: int = 0) -> torch.Generator:
    """A random stream for one row, from ``seed``, the row's ``text`` (its question) and a ``step`` (an iteration):
    the same samples whatever batch the row runs in, beside whichever rows, in whatever order."""
    digest = hashlib.sha256(f"{seed}\x1f{step}\x1f{text}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def generate(
    llm: LLM,
    prompts: list[str],
    max_new_tokens: int,
    *,
    add_special_tokens: bool = True,
    stop: Sequence[str] = ("\n",),
    batch_size: int = 16,
    generators: list[torch.Generator] | None = None,
    temperature: float = 1.0,
    on_batch: OnBatch | None = None,
    cache: KVCache | None = None,
) -> list[Generation]:
    """Each prompt's continuation, ``batch_size`` prompts of similar length at a time: each prompt runs on its longest
    prefix in ``cache`` (and its states are kept there; without a cache, only the prefixes the batch's prompts share
    run once), then the rows decode in lockstep (:class:`~detectors.llm.decoder.Decoder`): greedy, or sampled at
    ``temperature`` from each row's own generator (``generators``, one per prompt). A row ends at the end of sequence,
    at a stop string or after ``max_new_tokens`` tokens. ``on_batch`` hears of each batched call (its rows, forward
    calls and seconds)."""
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts: give one per prompt")
    tok = llm.tokenizer
    rows = [tok(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts]
    out: list[Generation | None] = [None] * len(rows)
    decoder = Decoder(llm, max_new_tokens, stop, temperature=temperature)
    for idx in batches(rows, batch_size):
        start = time.perf_counter()
        calls = [0]

        def count(_: list[int], n: int, __: float) -> None:
            calls[0] += n

        done = prefill(llm, [rows[i] for i in idx], cache, batch_size=len(idx), keep_kv=True, on_batch=count)
        decoded = [
            Row(ran=list(rows[i]), kv=kv, logits=x, generator=generators[i] if generators is not None else None)
            for i, kv, x in zip(idx, done.kv, done.logits)
        ]
        decoder.decode(decoded)
        passes = max(r.passes for r in decoded)
        for row, i in zip(decoded, idx):
            said = row.gen + ([row.stop_token] if row.stop_token is not None else [])
            out[i] = Generation(said, decoder.final_text(said))
        if on_batch is not None:
            on_batch(list(idx), calls[0] + passes, time.perf_counter() - start)
    return out  # type: ignore[return-value]
