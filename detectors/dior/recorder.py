"""Real-time detection (DioR §3.1.2, Alg. 2): what the LLM's generation looks like token by token.

``GenerationRecorder`` serves users who call ``model.generate``: a ``LogitsProcessor`` with forward hooks that, while
``model.generate`` runs, captures each generated token's hidden states at the chosen layers and its probability and
entropy — never a second pass over the text. The set itself is built by :func:`generate_traced`, with the shared
decoder the RAG loop generates with (the same tokens, probabilities, entropies and hidden states).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from transformers import LogitsProcessor

from detectors.config.schema import RealtimePromptParams
from detectors.llm.decoder import Decoder, Row
from detectors.llm.distribution import entropy as token_entropy
from detectors.llm.layers import StateTap
from detectors.llm.loading import LLM
from detectors.llm.prefill import prefill


@dataclasses.dataclass
class TokenTrace:
    """What the recorder saw of one sequence's generated tokens (the last token has no trace: its own
    hidden state is computed only by the next forward pass)."""

    gen_ids: list[int]
    hidden: np.ndarray  # [n, layers*hidden] float16, the token's own position
    prob: np.ndarray  # [n] probability the LLM gave the token when choosing it
    entropy: np.ndarray  # [n] entropy of that distribution (nats)
    scores: np.ndarray | None = None  # [n] detector probabilities when a scorer was attached


class GenerationRecorder(LogitsProcessor):
    """Attach to ``model.generate(..., logits_processor=[recorder])`` inside ``with recorder:``.

    At each decoding step the hooks catch the hidden state of the token fed in (the one generated at
    the previous step) and ``__call__`` pairs it with the probability and entropy that token had.
    ``scorer(hidden, prob, entropy) -> P(hallucination)`` (optional) scores each token as soon as its
    features exist. Works for a hand-written loop too: call ``recorder(input_ids, logits)`` after
    every forward pass of the model while the hooks are attached.
    """

    def __init__(self, model: torch.nn.Module, state_indices: list[int], scorer: Callable | None = None):
        self.model, self.state_indices, self.scorer = model, state_indices, scorer
        self.device = next(model.parameters()).device  # the hidden states' (model.generate gives the logits on
        # input_ids' device, which may be the host's)
        self.tap = StateTap(model, state_indices)  # the hooks (the RAG loop's probe of the same states)
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self._prev_logp: torch.Tensor | None = None
        self._prev_entropy: torch.Tensor | None = None
        self.tokens: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.prob: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []

    def __enter__(self) -> GenerationRecorder:
        self.reset()
        self.tap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.tap.__exit__(*exc)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # everything stays on the LLM's device (no host copy, no sync): ``traces`` moves it to the host once
        logp = torch.log_softmax(scores.to(self.device, torch.float32), dim=-1)
        if self.calls > 0:  # not the prompt's prefill: the last position is the token just generated
            if not self.tap.caught:
                raise RuntimeError("the recorder's hooks caught nothing: use it inside `with recorder:`")
            token = input_ids[:, -1].to(logp.device, copy=True)  # a copy: a view would keep every step's input_ids
            hidden = self.tap.take()[:, -1]
            prob = self._prev_logp.gather(1, token[:, None])[:, 0].exp()
            entropy = self._prev_entropy
            self.tokens.append(token)
            self.hidden.append(hidden)
            self.prob.append(prob)
            self.entropy.append(entropy)
            if self.scorer is not None:
                self.scores.append(torch.as_tensor(self.scorer(hidden, prob, entropy)))
        self._prev_logp = logp
        self._prev_entropy = token_entropy(logp)
        self.calls += 1
        return scores

    def traces(self, eos_ids: set[int], limit: int | None = None) -> list[TokenTrace]:
        """One trace per batch row, cut before the row's first end-of-sequence token (and at ``limit``); what the
        recorder kept on the LLM's device comes to the host here, once."""
        if not self.tokens:
            return []
        tokens = torch.stack(self.tokens, 1).cpu().tolist()
        hidden = torch.stack(self.hidden, 1).cpu().numpy()
        prob = torch.stack(self.prob, 1).float().cpu().numpy()
        entropy = torch.stack(self.entropy, 1).float().cpu().numpy()
        scores = (
            torch.stack([torch.as_tensor(s).reshape(-1) for s in self.scores], 1).float().cpu().numpy()
            if self.scores
            else None
        )
        out = []
        for b, ids in enumerate(tokens):
            n = min(
                next((i for i, t in enumerate(ids) if t in eos_ids), len(ids)), limit if limit is not None else len(ids)
            )
            out.append(
                TokenTrace(
                    gen_ids=ids[:n],
                    hidden=hidden[b, :n],
                    prob=prob[b, :n],
                    entropy=entropy[b, :n],
                    scores=None if scores is None else scores[b, :n],
                )
            )
        return out


def eos_ids(llm: LLM) -> set[int]:
    eos = llm.model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    if llm.tokenizer.pad_token_id is not None:
        ids.add(llm.tokenizer.pad_token_id)
    return ids


def render_prompt(llm: LLM, title: str, text: str, prompt: RealtimePromptParams) -> str:
    """DioR's continuation prompt; with ``chat`` the instruction is a user turn and the reply starts with the text."""
    body = prompt.template.format(title=title, text=text)
    if not prompt.chat:
        return body
    instruction = prompt.template.split("{text}")[0].format(title=title).rstrip()
    messages = [{"role": "user", "content": f"{instruction}\n\n{text}"}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + text


def generate_traced(
    llm: LLM,
    prompts: list[str],
    state_indices: list[int],
    max_new_tokens: int,
    chat: bool,
    scorer: Callable | None = None,
) -> tuple[list[list[int]], list[TokenTrace]]:
    """Greedy continuations of ``prompts`` with every token's trace, up to the end of sequence or ``max_new_tokens``
    tokens: the prompts run on their shared prefixes (:func:`~detectors.llm.prefill.prefill`), then the shared decoder
    (:class:`~detectors.llm.decoder.Decoder`, the RAG loop's) generates them in lockstep, the hidden states of each
    token caught at its own position as it runs (the last kept token runs too). What :class:`GenerationRecorder`
    records of ``model.generate``; ``scorer`` scores each continuation's tokens once it is complete."""
    tok = llm.tokenizer
    prompt_ids = [tok(p, add_special_tokens=not chat)["input_ids"] for p in prompts]
    ran = prefill(llm, prompt_ids, batch_size=len(prompt_ids), keep_kv=True)
    decoder = Decoder(llm, max_new_tokens, probes={"states": StateTap(llm.model, state_indices)}, eos=eos_ids(llm))
    rows = [Row(ran=list(ids), kv=kv, logits=x) for ids, kv, x in zip(prompt_ids, ran.kv, ran.logits)]
    del ran  # the rows hold the prompts' states, and the decoder lets them go once its batch holds them
    decoder.decode(rows)
    width = len(state_indices) * llm.fingerprint.hidden_size
    traces = []
    for row in rows:
        n = len(row.gen)
        hidden = torch.cat(row.values["states"])[:n] if n else torch.zeros(0, width, dtype=torch.float16)
        prob, entropy = (torch.tensor(v, dtype=torch.float32, device=hidden.device) for v in (row.prob, row.entropy))
        scores = None
        if scorer is not None:
            scores = (
                torch.as_tensor(scorer(hidden, prob, entropy)).reshape(-1).float().cpu().numpy()
                if n
                else np.zeros(0, np.float32)
            )
        traces.append(
            TokenTrace(list(row.gen), hidden.cpu().numpy(), prob.cpu().numpy(), entropy.cpu().numpy(), scores)
        )
    return prompt_ids, traces


def feature_rows(hidden: torch.Tensor, prob: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """Per-token inputs of the MLP, on the tensors' device: the hidden states rounded to float16 (as stored), the
    token's probability, its log (clipped at 1e-9) and the entropy, as float32 rows."""
    prob = prob.to(torch.float32).reshape(-1, 1)
    extra = torch.cat([prob, prob.clamp_min(1e-9).log(), entropy.to(torch.float32).reshape(-1, 1)], 1)
    return torch.cat([hidden.to(torch.float16).to(torch.float32), extra], 1)


def token_features(hidden: np.ndarray, prob: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    """:func:`feature_rows` of stored features (numpy in and out): what the detectors are trained on."""
    return feature_rows(
        torch.from_numpy(np.require(hidden, np.float16, "CW")),
        torch.from_numpy(np.require(prob, np.float32, "CW")),
        torch.from_numpy(np.require(entropy, np.float32, "CW")),
    ).numpy()
