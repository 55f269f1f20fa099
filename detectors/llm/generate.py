"""Batched generation for the LLM's own instruction calls (RetroRAG's generators and SC-generator, CtrlA's query rewrite):
left-padded ``model.generate`` in batches of similar length, greedy or sampled from one seeded random stream per row,
so that a row's continuation never depends on the rows beside it or on the batch size."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from detectors.llm.kv import ForwardCounter, batches

if TYPE_CHECKING:
    from detectors.llm.loading import LLM

OnBatch = Callable[[list[int], int, float], None]  # (row indices, forward calls, seconds) of one batched call


def instruction_prompt(llm: "LLM", content: str, chat: bool) -> str:
    """An instruction as the LLM reads it: with ``chat`` a user turn followed by the assistant's header."""
    if not chat:
        return content
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


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


class _RowSampler(LogitsProcessor):
    """Samples every row's next token at ``temperature`` from its own generator (one uniform per step, inverse CDF on
    the CPU in float64) and leaves only that token possible, so that greedy search takes it."""

    def __init__(self, generators: list[torch.Generator], temperature: float):
        self.generators, self.temperature = generators, temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.double() / self.temperature, dim=-1).cpu()
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators])
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(probs.shape[-1] - 1)[:, 0].to(scores.device)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(tokens), device=scores.device), tokens] = 0.0
        return out


class _StopStrings(StoppingCriteria):
    """Ends each row once its continuation holds a stop string."""

    def __init__(self, tokenizer, start: int, stop: Sequence[str]):
        self.tokenizer, self.start, self.stop = tokenizer, start, tuple(stop)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start :], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in texts], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def left_padding(tokenizer):
    """The tokenizer pads on the left for the duration (generation continues every row at its end), then as before."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side = side


def generate(
    llm: "LLM", prompts: list[str], max_new_tokens: int, *, add_special_tokens: bool = True, stop: Sequence[str] = ("\n",),
    batch_size: int = 16, generators: list[torch.Generator] | None = None, temperature: float = 1.0, on_batch: OnBatch | None = None,
) -> list[Generation]:  # fmt: skip
    """Each prompt's continuation, in left-padded batches of similar length: greedy, or sampled at ``temperature`` from
    each row's own generator (``generators``, one per prompt). A row ends at the end of sequence, at a stop string or
    after ``max_new_tokens`` tokens. ``on_batch`` hears of each batched call (its rows, forward calls and seconds)."""
    if generators is not None and len(generators) != len(prompts):
        raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts: give one per prompt")
    tok, eos = llm.tokenizer, llm.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    rows = [tok(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompts]
    out: list[Generation | None] = [None] * len(rows)
    for idx in batches(rows, batch_size):
        with left_padding(tok):
            enc = tok.pad({"input_ids": [rows[i] for i in idx]}, padding=True, return_tensors="pt")
        width = enc["input_ids"].shape[1]
        processors = LogitsProcessorList([_RowSampler([generators[i] for i in idx], temperature)] if generators is not None else [])
        criteria = StoppingCriteriaList([_StopStrings(tok, width, stop)] if stop else [])
        start = time.perf_counter()
        with torch.no_grad(), ForwardCounter(llm.model) as counter:
            seqs = llm.model.generate(enc["input_ids"].to(llm.device), attention_mask=enc["attention_mask"].to(llm.device), max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=1, pad_token_id=pad, logits_processor=processors, stopping_criteria=criteria)  # fmt: skip
        for b, i in enumerate(idx):
            said: list[int] = []
            for token in seqs[b, width:].tolist():
                if token in eos:
                    break
                said.append(token)
                if stop and any(s in tok.decode(said, skip_special_tokens=True) for s in stop):
                    break
            text = tok.decode(said, skip_special_tokens=True)
            for s in stop:
                text = text.split(s, 1)[0]
            out[i] = Generation(said, text.strip())
        if on_batch is not None:
            on_batch(list(idx), counter.calls, time.perf_counter() - start)
    return out  # type: ignore[return-value]
