"""Text normalisation, sentence splitting and DioR's containment label rule (R ⊆ A)."""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
# a sentence ends at . ! or ? (maybe inside a closing quote or bracket) followed by whitespace and a character that
# can open one (a capital, a digit, a quote, a parenthesis): "e.g. the" and "approx. two" are not split
_SENTENCE_BREAK = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[A-Z0-9\"'(])")


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` by punctuation (no model): what the retrieval corpus and the prompt's passage
    chunks are cut into. Empty pieces are dropped."""
    return [s for s in _SENTENCE_BREAK.split(text.strip()) if s]


def normalize_text(text: str) -> str:
    """SQuAD-style normalisation made unicode-aware: NFKC, accents and punctuation removed, lowercase,
    articles dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = "".join(" " if (c in _PUNCT or unicodedata.category(c).startswith("P")) else c for c in text.lower())
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def contains_reference(answer: str, references: Iterable[str]) -> bool:
    """DioR's label rule R ⊆ A: some normalised reference occurs in the normalised answer as whole words."""
    words = normalize_text(answer).split()
    for ref in references:
        ref_words = normalize_text(ref).split()
        n = len(ref_words)
        if n and any(words[i : i + n] == ref_words for i in range(len(words) - n + 1)):
            return True
    return False
