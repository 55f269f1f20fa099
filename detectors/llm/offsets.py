"""Characters of decoded tokens: where each token of a sequence stands in the text the sequence decodes to, which
tokens overlap a character span, and the whole words of a span with their tokens.

Spans are read from characters, not from tokens decoded one by one: a byte-level token may hold part of a
character (decoded alone it is U+FFFD), so a name such as Zürich is whole only in the text its tokens make together.
(:mod:`detectors.llm.words` groups tokens into words by their decoded pieces, for the token masks of CtrlA and
DRAGIN; keywords and entity labels go from character spans to tokens, here.)
"""

from __future__ import annotations

import unicodedata

from detectors.llm.loading import LLM

_REPLACEMENT = "\ufffd"  # what a byte-level decoder gives for the bytes of an unfinished character
_APOSTROPHES = "'\u2019"  # inside a word they join it: Kenya's, don't, O'Brien


def token_offsets(llm: LLM, gen_ids: list[int]) -> list[int]:
    """Character offset of each generated token in the decoded continuation (plus the end).

    Offsets count whole characters: a prefix that stops inside a character's UTF-8 bytes decodes with a trailing
    replacement character (U+FFFD), which is not counted unless the text itself holds one there, so every token
    of a character split over several tokens overlaps it (:func:`entity_tokens`).
    """
    text = llm.tokenizer.decode(gen_ids, skip_special_tokens=True)
    out = []
    for i in range(len(gen_ids) + 1):
        prefix = llm.tokenizer.decode(gen_ids[:i], skip_special_tokens=True)
        n = len(prefix)
        while n and prefix[n - 1] == _REPLACEMENT and (n > len(text) or text[n - 1] != _REPLACEMENT):
            n -= 1
        out.append(n)
    return out


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


def _word_char(c: str) -> bool:
    return c.isalnum() or unicodedata.category(c).startswith("M")  # letters, digits, combining accents


def word_spans_of(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """The character spans ``[a, b)`` of the whole words within ``text[start:end]``, Unicode-aware.

    A word is a run of letters, digits and combining marks, with an apostrophe inside it joining two such runs
    (Zürich, São, Kenya's); underscores, hyphens, other punctuation and whitespace separate words, as the word
    boundaries of GPT-2-style byte-level tokenizers do (Saint-Étienne is two words).
    """
    end = len(text) if end is None else end
    spans, i = [], start
    while i < end:
        if not text[i].isalnum():
            i += 1
            continue
        j = i + 1
        while j < end and (_word_char(text[j]) or (text[j] in _APOSTROPHES and j + 1 < end and text[j + 1].isalnum())):
            j += 1
        spans.append((i, j))
        i = j
    return spans


def words_and_tokens(
    text: str, offsets: list[int], start: int = 0, end: int | None = None
) -> list[tuple[str, list[int]]]:
    """The whole words of ``text[start:end]`` (:func:`word_spans_of`), each with the indices of the tokens that
    overlap it (:func:`entity_tokens` over ``offsets``, :func:`token_offsets` of the tokens ``text`` decodes from).

    Keywords are read from these, not from tokens decoded one by one: a name whose UTF-8 bytes span tokens (Zürich)
    decodes token by token into replacement characters and fragments, and a query needs the word.
    """
    return [(text[a:b], entity_tokens(offsets, a, b)) for a, b in word_spans_of(text, start, end)]
