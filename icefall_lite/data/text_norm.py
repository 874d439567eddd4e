"""Text normalisation to LibriSpeech's transcript character set.

LibriSpeech transcripts are upper case and use only ``A-Z``, the apostrophe and
single spaces.  :func:`normalize_text` turns free text (fortunes, user text)
into that form: numbers and ordinals are spelled out, a few abbreviations are
expanded, accents are stripped, punctuation is removed.  Whatever cannot be
normalised makes it raise :class:`TranscriptError`, which names the offending
characters.  :func:`validate_transcript` is the strict check used on
transcripts read from a corpus: it only upper-cases and collapses spaces, and
refuses anything else with a message naming where the transcript came from.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterator, List

ALLOWED_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ' ")
"""The characters a LibriSpeech transcript may contain."""

_ONES = (
    "ZERO ONE TWO THREE FOUR FIVE SIX SEVEN EIGHT NINE TEN ELEVEN TWELVE "
    "THIRTEEN FOURTEEN FIFTEEN SIXTEEN SEVENTEEN EIGHTEEN NINETEEN"
).split()
_TENS = "_ _ TWENTY THIRTY FORTY FIFTY SIXTY SEVENTY EIGHTY NINETY".split()
_SCALES = ((10**9, "BILLION"), (10**6, "MILLION"), (1000, "THOUSAND"))
_ORDINAL_WORDS = {
    "ONE": "FIRST",
    "TWO": "SECOND",
    "THREE": "THIRD",
    "FIVE": "FIFTH",
    "EIGHT": "EIGHTH",
    "NINE": "NINTH",
    "TWELVE": "TWELFTH",
}
_ABBREVIATIONS = {
    "mr.": "mister",
    "mrs.": "missus",
    "dr.": "doctor",
    "st.": "saint",
    "jr.": "junior",
    "sr.": "senior",
    "vs.": "versus",
    "etc.": "et cetera",
    "prof.": "professor",
    "gen.": "general",
    "capt.": "captain",
    "lt.": "lieutenant",
    "mt.": "mount",
}
_SYMBOLS = {"&": " and ", "%": " percent ", "+": " plus ", "=": " equals ", "@": " at "}
_QUOTES = {"\u2018": "'", "\u2019": "'", "\u02bc": "'", "`": "'", "\u201c": '"', "\u201d": '"'}

_ABBREV_RE = re.compile(
    r"(?<![A-Za-z])(" + "|".join(re.escape(a) for a in _ABBREVIATIONS) + r")",
    re.IGNORECASE,
)
_MONEY_RE = re.compile(r"\$(\d+)")
_DECIMAL_RE = re.compile(r"\b(\d+)\.(\d+)\b")
_ORDINAL_RE = re.compile(r"\b(\d+)(st|nd|rd|th)\b", re.IGNORECASE)
_INT_RE = re.compile(r"\b\d{1,3}(?:,\d{3})+\b|\b\d+\b")
_SENTENCE_END_RE = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


class TranscriptError(ValueError):
    """A transcript holds characters outside LibriSpeech's set."""


def number_to_words(n: int) -> str:
    """Spell out a non-negative integer in upper-case English words.

    >>> number_to_words(1984)
    'ONE THOUSAND NINE HUNDRED EIGHTY FOUR'
    """
    if n < 0:
        raise ValueError(f"number_to_words: negative number {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + ("" if ones == 0 else " " + _ONES[ones])
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        head = _ONES[hundreds] + " HUNDRED"
        return head if rest == 0 else head + " " + number_to_words(rest)
    for scale, name in _SCALES:
        if n >= scale:
            high, rest = divmod(n, scale)
            head = number_to_words(high) + " " + name
            return head if rest == 0 else head + " " + number_to_words(rest)
    raise ValueError(f"number_to_words: {n} is too large")  # pragma: no cover


def ordinal_to_words(n: int) -> str:
    """Spell out an ordinal number (``21`` -> ``TWENTY FIRST``)."""
    words = number_to_words(n).split()
    last = words[-1]
    if last in _ORDINAL_WORDS:
        words[-1] = _ORDINAL_WORDS[last]
    elif last.endswith("Y"):
        words[-1] = last[:-1] + "IETH"
    else:
        words[-1] = last + "TH"
    return " ".join(words)


def _spell_numbers(text: str) -> str:
    text = _MONEY_RE.sub(lambda m: f"{m.group(1)} dollars", text)
    text = _DECIMAL_RE.sub(lambda m: f" {m.group(1)} point " + " ".join(_ONES[int(d)] for d in m.group(2)) + " ", text)
    text = _ORDINAL_RE.sub(lambda m: " " + ordinal_to_words(int(m.group(1))) + " ", text)
    return _INT_RE.sub(lambda m: " " + number_to_words(int(m.group(0).replace(",", ""))) + " ", text)


def _strip_accents(text: str) -> str:
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def _clean_apostrophes(text: str) -> str:
    """Keep apostrophes inside words (DON'T, JONES'S); drop quoting ones."""
    words = []
    for word in text.split():
        word = word.strip("'")
        if word:
            words.append(word)
    return " ".join(words)


def outside_chars(text: str) -> List[str]:
    """The sorted distinct characters of ``text`` outside :data:`ALLOWED_CHARS`."""
    return sorted({c for c in text if c not in ALLOWED_CHARS})


def normalize_text(text: str) -> str:
    """Normalise free text to a LibriSpeech transcript.

    Numbers, decimals, ordinals and ``$N`` are spelled out, common abbreviations are
    expanded, accents are stripped, hyphens and slashes become spaces and other
    punctuation is removed.  The result is upper case with single spaces.

    Raises:
        TranscriptError: characters remain that have no normal form (digits in
            a form not handled, symbols from other scripts, ...); the message
            lists them.
    """
    for bad, good in _QUOTES.items():
        text = text.replace(bad, good)
    text = _strip_accents(text)
    text = _ABBREV_RE.sub(lambda m: " " + _ABBREVIATIONS[m.group(1).lower()] + " ", text)
    for symbol, word in _SYMBOLS.items():
        text = text.replace(symbol, word)
    text = _spell_numbers(text)
    text = re.sub(r"[-/_\u2013\u2014]", " ", text)
    text = re.sub(r"[.,;:!?\"()\[\]{}*~<>|\\^#]", " ", text)
    text = _clean_apostrophes(text.upper())
    bad = outside_chars(text)
    if bad:
        raise TranscriptError(f"cannot normalise {text!r}: characters outside A-Z, apostrophe and space remain: {bad}")
    return text


def validate_transcript(text: str, where: str) -> str:
    """Strictly check a corpus transcript; return it upper-cased, spaces collapsed.

    Args:
        text: the transcript as read from the corpus.
        where: where it came from (file and line, utterance id) for the error.

    Raises:
        TranscriptError: the transcript is empty or holds characters outside
            LibriSpeech's set; the message names ``where``, the characters and
            the fix.
    """
    upper = " ".join(text.upper().split())
    if not upper:
        raise TranscriptError(f"{where}: empty transcript")
    bad = outside_chars(upper)
    if bad:
        raise TranscriptError(
            f"{where}: transcript {text!r} has characters outside LibriSpeech's "
            f"set (A-Z, apostrophe, space): {bad}. Fix the transcript (for example "
            f"with icefall_lite.data.text_norm.normalize_text) and rerun."
        )
    return upper


def split_sentences(text: str) -> Iterator[str]:
    """Split a paragraph into sentences on ``.``, ``!`` and ``?``.

    Abbreviations known to :func:`normalize_text` do not end a sentence.
    """
    protected = _ABBREV_RE.sub(lambda m: m.group(1)[:-1] + "\0", text)
    for piece in _SENTENCE_END_RE.split(" ".join(protected.split())):
        piece = piece.replace("\0", ".").strip()
        if piece:
            yield piece
