"""Words of a token sequence: which tokens form one word, and which words carry content (not a stop word
or punctuation). Shared by CtrlA's retrieval trigger (new content words) and DRAGIN's RIND (content words).

Stop words are spaCy's English list by default; a caller with a loaded spaCy pipeline passes its
``nlp.Defaults.stop_words``.
"""

from __future__ import annotations

import re

from spacy.lang.en.stop_words import STOP_WORDS

from detectors.errors import InputError
from detectors.sources.text import normalize_text, split_sentences

DEFAULT_STOPWORDS: frozenset[str] = frozenset(STOP_WORDS)
SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def ends_sentence(tokenizer, token_id: int) -> bool:
    """Whether a generated token ends a sentence (where the RAG loop ends a segment): its text, right-stripped, ends
    with ``.``, ``!`` or ``?`` and any closing quotes or brackets."""
    return bool(SENTENCE_END.search(tokenizer.decode([int(token_id)], skip_special_tokens=True).rstrip()))


def spacy_stopwords(model: str, key: str) -> frozenset[str]:
    """The stop words of the installed spaCy pipeline ``model`` (``key`` names the setting in the error)."""
    import spacy

    try:
        return frozenset(spacy.load(model).Defaults.stop_words)
    except OSError as err:
        raise InputError(
            f"{key} = {model!r} cannot be loaded: install that spaCy pipeline or name an installed one ({err})"
        ) from err


def token_words(tokenizer, ids: list[int]) -> list[int]:
    """The word index of each token: a token starting with whitespace, or a punctuation token, starts a word. A
    byte-level token holding part of a character (decoded alone as U+FFFD) belongs to the word around it."""
    word, out, prev_punct = -1, [], True
    for t in ids:
        piece = tokenizer.decode([t], skip_special_tokens=True)
        punct = not any(c.isalnum() or c == "\ufffd" for c in piece)
        if word < 0 or piece[:1].isspace() or punct or prev_punct:
            word += 1
        out.append(word)
        prev_punct = punct
    return out


def spaced_words(tokenizer, ids: list[int]) -> list[int]:
    """The word index of each token when words are whitespace-delimited (punctuation stays with its word): a token
    whose text starts with whitespace starts a word, as DRAGIN's released code merges tokens."""
    word, out = -1, []
    for t in ids:
        piece = tokenizer.decode([t], skip_special_tokens=True)
        if word < 0 or piece[:1].isspace():
            word += 1
        out.append(word)
    return out


def sentence_of(pieces: list[str]) -> list[int]:
    """The sentence (counted from 0) that each of the consecutive ``pieces`` of a text (its words, say) belongs to,
    where :func:`~detectors.sources.text.split_sentences` cuts the text they make together; a piece belongs where its
    first non-space character is."""
    text, starts, pos = "".join(pieces), [], 0
    for sentence in split_sentences(text):
        pos = text.index(sentence, pos)
        starts.append(pos)
        pos += len(sentence)
    out, offset = [], 0
    for piece in pieces:
        first = offset + len(piece) - len(piece.lstrip())
        out.append(max(sum(s <= first for s in starts) - 1, 0))
        offset += len(piece)
    return out


def word_spans(tokenizer, ids: list[int]) -> list[tuple[list[int], str]]:
    """Each word of ``ids`` in order: its token indices and its text (the word's tokens decoded together, so a
    character split over two byte-level tokens comes out whole)."""
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(token_words(tokenizer, ids)):
        groups.setdefault(w, []).append(i)
    return [(idx, tokenizer.decode([ids[i] for i in idx], skip_special_tokens=True)) for idx in groups.values()]


def _word_texts(tokenizer, ids: list[int]) -> tuple[list[int], dict[int, str]]:
    """Each token's word index and each word's normalised text."""
    spans = word_spans(tokenizer, ids)
    words = [w for w, (idx, _) in enumerate(spans) for _ in idx]  # a word's tokens are consecutive
    return words, {w: normalize_text(text) for w, (_, text) in enumerate(spans)}


def _is_content(norm: str, stopwords: frozenset[str]) -> bool:
    return bool(norm) and all(part not in stopwords for part in norm.split())


def word_mask(tokenizer, ids: list[int], stopwords: frozenset[str] = DEFAULT_STOPWORDS) -> list[bool]:
    """Which tokens belong to a content word: a word that is neither punctuation nor a stop word (DRAGIN's s_i)."""
    words, texts = _word_texts(tokenizer, ids)
    flags = {w: _is_content(norm, stopwords) for w, norm in texts.items()}
    return [flags[w] for w in words]


def content_mask(
    tokenizer, context_text: str, ids: list[int], stopwords: frozenset[str] = DEFAULT_STOPWORDS
) -> list[bool]:
    """Which tokens carry new information (CtrlA §3.2.3, App. B.2): their word is not a stopword or
    punctuation, and does not occur in the context (the input and the preceding generation)."""
    seen = set(normalize_text(context_text).split())
    words, texts = _word_texts(tokenizer, ids)
    flags = {}
    for w, norm in texts.items():
        flags[w] = _is_content(norm, stopwords) and norm not in seen
        if flags[w]:
            seen.add(norm)  # a word is new only the first time it appears
    return [flags[w] for w in words]
