"""CtrlA's refusal handling module H_R (App. B.3, Alg. 2), as the RAG loop runs it for a segment re-predicted after
a retrieval: the refusal detector f_d and the query rewrite f_QR (Prompt B.2)."""

from __future__ import annotations

import dataclasses
from typing import Any

from detectors.ctrla.monitor import detect_refusal
from detectors.llm.generate import OnBatch, generate, instruction_prompt
from detectors.llm.loading import LLM


@dataclasses.dataclass
class RefusalHandler:
    """f_d: the confidence detector's refusal ``patterns``; f_QR: ``params``
    (:class:`~detectors.config.rag.CtrlARefusalParams`): the LLM writes a better search query from the question and the
    previous query, greedily; its first line (the question when it writes nothing). At most ``max_attempts`` (K)
    rewrites per segment."""

    llm: LLM
    patterns: list[str]
    params: Any

    @property
    def max_attempts(self) -> int:
        return self.params.max_attempts

    def refuses(self, text: str) -> bool:
        return detect_refusal(text, self.patterns) is not None

    def rewrite(self, questions: list[str], queries: list[str], on_batch: OnBatch | None = None) -> list[str]:
        """f_QR(q, q_t) of each question and its previous query, the rows batched."""
        p = self.params
        prompts = [
            instruction_prompt(self.llm, p.rewrite_template.format(question=q, query=r), p.chat)
            for q, r in zip(questions, queries)
        ]
        out = generate(
            self.llm, prompts, p.query_tokens, add_special_tokens=not p.chat, stop=("\n",), on_batch=on_batch
        )
        return [g.text.strip().strip("\"'") or q for g, q in zip(out, questions)]
