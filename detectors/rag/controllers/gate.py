"""A gate on the passages a question trigger retrieved (the retrieval-utility trigger's): once their prompt has run
and before any answer token, the gate judges them from what that pass gave, and the question is answered without them
when it rejects them."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import torch

from detectors.llm.distribution import entropy
from detectors.rag.controllers import Controller, Fire, Loop
from detectors.rag.decoder import Row


@dataclasses.dataclass
class PostRetrieval:
    """What a gate sees of a question once its passages are in the prompt, before any answer token: the question's
    early-set columns, the LLM's first-token distribution with the passages (the early set's ``first_token_*``
    statistics, measured on the new prompt), the hidden state of the prompt's last token at the gate's layers (its
    probe) and the retriever's scores."""

    question: str
    question_stats: dict[str, Any]
    first_token_prob: float
    first_token_entropy: float
    first_token_margin: float
    hidden: np.ndarray | None
    retrieval_scores: list[float]


class Gate(Protocol):
    """Judges passages (:class:`PostRetrieval`): they are kept when the score is at or above ``threshold``. ``probe``
    (or None) records the hidden states it reads, under ``key``."""

    key: str
    probe: Any
    threshold: float

    def judge(self, items: list[PostRetrieval]) -> list[float]: ...


@dataclasses.dataclass(frozen=True)
class Gated(Controller):
    """The plain retrieval, then ``gate`` on the passages before the answer (recorded as the retrieval's
    ``gate_score``; ``used=False`` when rejected)."""

    gate: Any  # Gate

    def parts(self) -> list[Any]:
        return [self.gate]

    def probes(self) -> dict[str, Any]:
        return {self.gate.key: self.gate.probe} if self.gate.probe is not None else {}

    def after_retrieval(self, fire: Fire) -> None:
        fire.row.judge = fire.trigger

    def prompt_ran(self, loop: Loop, rows: list[Row]) -> list[Row]:
        gate, items = self.gate, []
        for row in rows:
            logp = torch.log_softmax(row.logits.float(), dim=-1)
            top2 = torch.topk(logp.exp(), 2)
            hidden = None
            if gate.probe is not None:
                hidden = torch.cat(row.values[gate.key])[len(row.ran) - 1].float().cpu().numpy()
            first, margin = float(top2.values[0]), float(top2.values[0] - top2.values[1])
            scores = row.retrievals[-1].scores
            items.append(
                PostRetrieval(row.question, row.question_stats, first, float(entropy(logp)), margin, hidden, scores)
            )
        rejected = []
        for row, score in zip(rows, gate.judge(items)):
            retrieval = row.retrievals[-1]
            retrieval.gate_score = float(score)
            if score < gate.threshold:
                retrieval.used = False
                loop.set_prompt(row, None, row.question)
                rejected.append(row)
        return rejected
