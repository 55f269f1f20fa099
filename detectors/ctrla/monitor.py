"""CtrlA at generation time: the confidence monitor (Eq. 2), the retrieval trigger on new non-stopword
tokens, the refusal detector (App. B.3.1), query masking (Eq. 3) and one steered, monitored generation step.

The monitor's per-token score is computed by one function, :func:`running_scores`, over projections
captured by one hook class, whether the tokens are generated (serving) or teacher-forced (evaluation).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

from detectors.ctrla.directions import Directions
from detectors.ctrla.steering import steer
from detectors.evaluation.metrics import first_hit
from detectors.llm.decoder import Decoder, Row
from detectors.llm.kv import batches, forward_rows, prefix_kv, shared_prefix_length
from detectors.llm.layers import LayerTap
from detectors.llm.loading import LLM
from detectors.llm.words import content_mask, token_words
from detectors.sources.text import normalize_text

# ---- confidence monitor (Eq. 2) -----------------------------------------------------------------------


def running_scores(projections: torch.Tensor, tau: float = 0.0, clip: float = 3.0, skip: int = 1) -> torch.Tensor:
    """CtrlA Eq. 2 for every position: ``scale([m_0..m_k])[-1] - tau`` with ``m`` the layer-mean projections.

    ``scale`` standardises a token's projection by the mean and standard deviation of the sequence so
    far (itself included) and clips it to ``±clip`` (outlier removal). The first ``skip`` positions
    (the attention sink, whose activations are outliers) stay out of the statistics and score 0 - tau.
    ``projections`` is ``[B, T]``; right padding does not affect real positions (the statistics are causal).
    """
    x = projections.double()
    pos = torch.arange(x.shape[-1], device=x.device)
    valid = (pos >= skip).to(x.dtype).expand_as(x)
    n = valid.cumsum(-1).clamp_min(1)
    mean = (x * valid).cumsum(-1) / n
    var = ((x * valid) ** 2).cumsum(-1) / n - mean**2
    std = var.clamp_min(0).sqrt()
    z = torch.where(std > 1e-9, (x - mean) / std.clamp_min(1e-9), torch.zeros_like(x))
    z = z.clamp(-clip, clip) * valid
    return (z - tau).float()


class ConfidenceMonitor:
    """Projections ``r·v_c`` of every processed token at the monitored layers, averaged over layers.

    Attach it around generation or a teacher-forced forward pass (``with monitor: ...``); hooks are
    removed on exit. ``scores()`` gives Eq. 2 for every position seen since the last ``reset()``.
    """

    reads_context = True  # Eq. 2's running statistics read every position a pass saw, the prompt's too

    def __init__(
        self,
        model: torch.nn.Module,
        directions: Directions,
        layers: list[int] | None = None,
        tau: float = 0.0,
        clip: float = 3.0,
        skip: int = 1,
    ):
        self.model, self.layers = model, list(layers or directions.layers)
        self.tau, self.clip, self.skip = tau, clip, skip
        self.vectors = {layer: directions.vectors[layer - 1].float() for layer in self.layers}
        self._stacked = torch.stack([self.vectors[layer] for layer in self.layers])  # [n_layers, H]
        self._tap = LayerTap(model, self.layers, self._record)
        self.reset()

    def reset(self) -> None:
        self._chunks: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self._step: list[torch.Tensor] = []

    def project(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``r·v_l`` of every position of ``hidden`` (the residual stream after block ``layer``), in float32: the one
        projection, for this monitor's hooks and for a serving engine's (:mod:`detectors.serving.engine`)."""
        v = self.vectors[layer]
        if v.device != hidden.device:
            v = self.vectors[layer] = v.to(hidden.device)
        return hidden.detach().float() @ v

    def _record(self, layer: int, hidden: torch.Tensor) -> None:
        if hidden.shape[1] == 1:  # a decoding step: every monitored layer is projected at once, after the last one
            self._step.append(hidden.detach())
            if len(self._step) == len(self.layers):
                self._project_step()
            return
        self._chunks[layer].append(self.project(layer, hidden))

    def _project_step(self) -> None:
        """One decoding step's projections at every monitored layer in three operations (stack, cast, batched
        product) instead of two per layer: at batch 1 on a GPU a step is bound by launches, not arithmetic. Long
        passes (prompts) are projected layer by layer as they run, so no pass's states are kept beyond its layer."""
        states = torch.stack(self._step).float()  # [n_layers, B, 1, H]
        if self._stacked.device != states.device:
            self._stacked = self._stacked.to(states.device)
        projections = torch.einsum("lbth,lh->lbt", states, self._stacked)
        for layer, projection in zip(self.layers, projections):
            self._chunks[layer].append(projection)
        self._step = []

    def __enter__(self) -> ConfidenceMonitor:
        self._tap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tap.__exit__(*exc)

    def layer_projections(self, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, n_layers]`` projections at each monitored layer of all positions recorded so far; ``prefix``
        (``[1, P, n_layers]``) holds those of cached positions before them."""
        if not self._chunks[self.layers[0]]:
            raise RuntimeError("the confidence monitor has seen no tokens: run the LLM inside `with monitor:`")
        proj = torch.stack([torch.cat(self._chunks[layer], dim=-1) for layer in self.layers], dim=-1)
        if prefix is not None:
            proj = torch.cat([prefix.to(proj.device).expand(proj.shape[0], -1, -1), proj], dim=1)
        return proj

    def take(self) -> torch.Tensor:
        """``[B, T, n_layers]`` projections of the passes since the last reset, which they become (a probe of the
        RAG loop, whose passes feed it one at a time)."""
        out = self.layer_projections()
        self.reset()
        return out

    def projections(self) -> torch.Tensor:
        """``[B, T]`` layer-mean projections of all positions recorded so far (Eq. 2's mean-pooling)."""
        return self.layer_projections().mean(-1)

    def scores(self) -> torch.Tensor:
        """Eq. 2 scores ``[B, T]`` of all positions recorded so far (< 0: unconfident)."""
        return running_scores(self.projections(), self.tau, self.clip, self.skip)


def project_sequences(
    llm: LLM,
    directions: Directions,
    sequences: list[list[int]],
    layers: list[int],
    batch_size: int = 16,
    progress=None,
) -> list[np.ndarray]:
    """Projections ``r·v_l`` ``[T, len(layers)]`` of every position of each token sequence at each of ``layers``,
    by teacher forcing with the served monitor's hooks. The token prefix shared by all sequences (a chat
    header, a few-shot prompt) runs once. :func:`pooled_scores` turns them into Eq. 2 for any subset of layers.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("project_sequences needs non-empty token sequences")
    first = sequences[0]
    common = shared_prefix_length(sequences)
    monitor = ConfidenceMonitor(llm.model, directions, layers)
    kv, prefix_proj = None, None
    if common:
        with monitor:
            kv = prefix_kv(llm.model, torch.tensor([first[:common]], device=llm.device), common)
        prefix_proj = monitor.layer_projections()
    rows = [s[common:] for s in sequences]
    out: list[np.ndarray] = [np.zeros((0, len(layers)))] * len(rows)
    for idx in batches(rows, batch_size):
        monitor.reset()
        with monitor:
            forward_rows(llm, kv, [rows[i] for i in idx])
        proj = monitor.layer_projections(prefix_proj).cpu().numpy()
        for b, i in enumerate(idx):
            out[i] = proj[b, : len(sequences[i])]
        if progress is not None:
            progress.update(len(idx))
    return out


def pooled_scores(
    projections: np.ndarray | torch.Tensor,
    tau: float = 0.0,
    clip: float = 3.0,
    columns: list[int] | None = None,
    skip: int = 1,
) -> np.ndarray:
    """Eq. 2 of every position (:func:`running_scores`) from per-layer projections ``[T, n_layers]`` (an array, or a
    tensor on any device), pooled over ``columns`` (all when None): the one pooling the monitor's segments, the RAG
    loop's CtrlA trigger and the offline scores share."""
    if not isinstance(projections, torch.Tensor):
        projections = torch.from_numpy(np.ascontiguousarray(projections))
    proj = projections if columns is None else projections[:, columns]
    return running_scores(proj.mean(-1)[None], tau, clip, skip)[0].cpu().numpy()


def score_sequences(
    llm: LLM,
    directions: Directions,
    sequences: list[list[int]],
    batch_size: int = 16,
    tau: float = 0.0,
    clip: float = 3.0,
    layers: list[int] | None = None,
    progress=None,
) -> list[np.ndarray]:
    """Eq. 2 score of every position of each token sequence at ``layers`` (the directions' own when None)."""
    projections = project_sequences(llm, directions, sequences, list(layers or directions.layers), batch_size, progress)
    return [pooled_scores(p, tau, clip) for p in projections]


# ---- the retrieval trigger: new, non-stopword tokens (content_mask, token_words: detectors.llm.words) ----

FIRING_RULE = "Eq. 2 confidence < 0 on a new content word"  # :func:`unconfident` and :func:`trigger_position`, in words

# The RAG loop's triggers fire at a score at or above their threshold (detectors.rag.triggers) and CtrlA's score there
# is -Eq. 2: the threshold that fires exactly where :func:`unconfident` holds is the smallest positive float, since
# -Eq. 2 >= it <=> Eq. 2 < 0 for every float (a threshold of 0.0 would also fire at Eq. 2 == 0, which is confident).
FIRING_THRESHOLD = float(np.nextafter(0.0, 1.0))


def unconfident(scores) -> np.ndarray:
    """CtrlA's firing rule, the one definition of it (CtrlA, arXiv 2405.18727, §3.2.3): a token is unconfident when
    its Eq. 2 score is strictly below zero ("if m_k < 0, LLM is unconfident in generating the k-th token"; "the
    retrieval trigger T activates if any confidence score in y'_t satisfies m_k < 0"). A score of exactly 0 is not
    unconfident. The monitor's trigger, Eq. 3's masking, the quality report's trigger rates, the ``dynrag monitor``
    command and the RAG loop's CtrlA trigger (:data:`FIRING_THRESHOLD`) all decide with it."""
    return np.asarray(scores, dtype=np.float64) < 0


def new_content(tokenizer, question: str, preceding: str, ids: list[int]) -> list[bool]:
    """CtrlA's new content (§3.2.3, Eq. 3's ``w ∉ q ∪ y<t``), the one definition the trigger, the monitor and the
    quality report read: the tokens of ``ids`` whose word is no stopword or punctuation and occurs neither in the
    question ``question`` (q, the task's input) nor in the preceding generation ``preceding`` (y<t), whatever else the
    prompt shows (a template's examples, retrieved passages) (:func:`~detectors.llm.words.content_mask`)."""
    return content_mask(tokenizer, f"{question} {preceding}", ids)


def trigger_position(scores, new_content) -> int | None:
    """CtrlA's retrieval trigger T on a generated segment: the first token that is new content (``new_content``: a
    new non-stopword word, :func:`~detectors.llm.words.content_mask`) and :func:`unconfident`; None when T does not
    fire."""
    return first_hit(unconfident(scores) & np.asarray(new_content, dtype=bool))


def hallucination_score(scores: np.ndarray, mask: list[bool], fallback: float) -> float:
    """A sequence's hallucination score: ``-min`` of Eq. 2 over the new non-stopword tokens (the token that
    fires CtrlA's trigger first), over all tokens when none is new, ``fallback`` when there are none.

    It ranks sequences (AUROC), it does not decide: where some token is new content, score > 0 exactly when
    :func:`trigger_position` fires; the all-tokens fallback scores a sequence the trigger cannot fire on (it reads only
    new content), so that such a sequence still has a rank."""
    scores = np.asarray(scores, dtype=np.float64)
    if len(scores) == 0:
        return float(fallback)
    picked = scores[np.asarray(mask, dtype=bool)] if any(mask) else scores
    return float(-picked.min())


# ---- refusal detector (App. B.3.1) and query masking (Eq. 3) ----------------------------------------


def detect_refusal(text: str, patterns: list[str]) -> str | None:
    """The first refusal pattern (case-insensitive regex) found in ``text``, or None."""
    text = text.replace("\u2019", "'").replace("\u2018", "'")
    for pattern in patterns:
        if re.search(pattern, text, flags=re.IGNORECASE):
            return pattern
    return None


def masked_query(tokenizer, question: str, context_text: str, ids: list[int], scores: np.ndarray) -> str:
    """Context-augmented query (Eq. 3): the question plus the segment without its words that are both new
    (not in the question or earlier generation) and unconfident (:func:`unconfident`: some token of the word)."""
    seen = set(normalize_text(f"{question} {context_text}").split())
    words = token_words(tokenizer, ids)
    kept: list[int] = []
    for w in sorted(set(words)):
        members = [i for i, x in enumerate(words) if x == w]
        text = tokenizer.decode([ids[i] for i in members], skip_special_tokens=True)
        new = normalize_text(text) not in seen if normalize_text(text) else False
        if not (new and unconfident([scores[i] for i in members]).any()):
            kept.extend(ids[i] for i in members)
    segment = tokenizer.decode(kept, skip_special_tokens=True).strip()
    return f"{question} {segment}".strip()


# ---- one generation step of a CtrlA loop ---------------------------------------------------------------


@dataclasses.dataclass
class Segment:
    """A generated segment with CtrlA's signals: what a RAG loop needs to decide on retrieval."""

    text: str
    token_ids: list[int]
    scores: list[float]  # Eq. 2 per generated token (:func:`unconfident`: < 0)
    new_content: list[bool]  # the trigger looks only at these tokens
    trigger_position: int | None  # the first generated token that fires trigger T (:func:`trigger_position`), or None
    refusal: str | None  # the refusal pattern found (f_d), if any
    query: str  # the context-augmented query (Eq. 3)

    @property
    def retrieve(self) -> bool:
        """Whether trigger T fires: some new non-stopword token is unconfident."""
        return self.trigger_position is not None


def generate_segment(
    llm: LLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    monitor: ConfidenceMonitor | None = None,
    steering: dict[int, torch.Tensor] | None = None,
    question: str = "",
    context_text: str = "",
    refusal_patterns: list[str] = (),
) -> Segment:
    """Greedy generation with honesty steering and the confidence monitor attached (CtrlA Alg. 1/3, lines 4-5), by
    the shared decoder the RAG loop generates with (:class:`~detectors.llm.decoder.Decoder`; the monitor is its probe,
    so the last generated token runs too and gets its own hidden state and score). ``question`` is q and
    ``context_text`` the preceding generation y<t: a word is new content when neither holds it."""
    hooks = (lambda: steer(llm.model, steering)) if steering else None
    decoder = Decoder(llm, max_new_tokens, probes={"ctrla": monitor} if monitor is not None else None, hooks=hooks)
    if monitor is not None:
        monitor.reset()
    row = Row(prompt=prompt_ids[0].tolist())
    decoder.prefill([row])
    decoder.decode([row])
    gen = row.gen
    text = llm.tokenizer.decode(gen, skip_special_tokens=True)
    if monitor is None or not gen:
        return Segment(text, gen, [], [], None, detect_refusal(text, list(refusal_patterns)), question)
    projections = torch.cat(row.values["ctrla"])[: len(row.prompt) + len(gen)]
    scores = pooled_scores(projections, monitor.tau, monitor.clip, skip=monitor.skip)[len(row.prompt) :]
    mask = new_content(llm.tokenizer, question, context_text, gen)
    return Segment(
        text=text,
        token_ids=gen,
        scores=scores.tolist(),
        new_content=mask,
        trigger_position=trigger_position(scores, mask),
        refusal=detect_refusal(text, list(refusal_patterns)),
        query=masked_query(llm.tokenizer, question, context_text, gen, scores),
    )
