"""Sentences for the synthetic corpus: Debian fortunes, normalised and split.

The pipeline: read every fortune file, drop attribution lines, split the
fortunes into sentences, normalise them to LibriSpeech's character set
(:mod:`icefall_lite.data.text_norm`), keep sentences of 5-20 words, remove
duplicates.  Sentences whose words all lie in the ``vocab_words`` most
frequent words form the speech pool; the others feed the babble noise, so no
sentence is used twice.  Evaluation sentences are drawn so that each of their
words still occurs in the sentences left for training (OOV rate 0 when the
whole remaining pool is used for training).
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Set, Tuple

import numpy as np

from icefall_lite.data.text_norm import TranscriptError, normalize_text, split_sentences

FORTUNE_DIR = Path("/usr/share/games/fortunes")
EXCLUDED_FORTUNE_FILES = frozenset({"ascii-art"})
_ATTRIBUTION_RE = re.compile(r"^\s*(--|\u2014|\u2013)")


def fortune_files(fortune_dir: Path = FORTUNE_DIR) -> List[Path]:
    """The plain-text fortune files of ``fortune_dir`` (no ``.dat``/``.u8``), sorted."""
    if not fortune_dir.is_dir():
        raise FileNotFoundError(
            f"no fortunes at {fortune_dir}: install the Debian packages fortune-mod and fortunes (`make setup` does it)"
        )
    files = [
        p
        for p in sorted(fortune_dir.iterdir())
        if p.is_file() and p.suffix not in (".dat", ".u8") and p.name not in EXCLUDED_FORTUNE_FILES
    ]
    if not files:
        raise FileNotFoundError(f"{fortune_dir} holds no fortune files")
    return files


def read_fortunes(path: Path) -> List[str]:
    """The fortunes of one file, each joined into one line, attributions removed."""
    text = path.read_text(encoding="utf-8", errors="replace")
    entries = []
    for entry in re.split(r"\n%\n", text):
        lines = [ln.strip() for ln in entry.splitlines() if not _ATTRIBUTION_RE.match(ln)]
        joined = " ".join(ln for ln in lines if ln and ln != "%")
        if joined:
            entries.append(joined)
    return entries


def sentence_pool(paragraphs: Iterable[str], min_words: int = 5, max_words: int = 20) -> List[str]:
    """Distinct normalised sentences of ``min_words``..``max_words`` words, in order."""
    seen: Set[str] = set()
    out = []
    for paragraph in paragraphs:
        for sentence in split_sentences(paragraph):
            try:
                norm = normalize_text(sentence)
            except TranscriptError:
                continue
            if min_words <= len(norm.split()) <= max_words and norm not in seen:
                seen.add(norm)
                out.append(norm)
    return out


def frequent_vocabulary(sentences: Sequence[str], size: int) -> Set[str]:
    """The ``size`` most frequent words of ``sentences`` (ties by first appearance)."""
    counts = collections.Counter(w for s in sentences for w in s.split())
    return {w for w, _ in counts.most_common(size)}


@dataclass
class TextSplits:
    """Sentences per use: training pool, evaluation parts, babble (noise only).

    ``babble`` keeps the order of the input sentences, so it does not depend on
    the seed (see :func:`babble_sentences`).
    """

    train: List[str]
    eval: Dict[str, List[str]] = field(default_factory=dict)
    babble: List[str] = field(default_factory=list)


def split_sentences_for_corpus(
    sentences: Sequence[str],
    vocab: Set[str],
    eval_parts: Sequence[str],
    eval_size: int,
    rng: np.random.Generator,
) -> TextSplits:
    """Assign each sentence to at most one use.

    In-vocabulary sentences are shuffled; evaluation parts take, in turn,
    sentences whose every word still occurs at least once in the sentences not
    yet taken for evaluation; the rest is the training pool.  Sentences with a
    word outside ``vocab`` are babble material.
    """
    in_vocab = [s for s in sentences if all(w in vocab for w in s.split())]
    order = [in_vocab[i] for i in rng.permutation(len(in_vocab))]
    remaining = collections.Counter(w for s in order for w in s.split())
    evals: Dict[str, List[str]] = {p: [] for p in eval_parts}
    taken: Set[int] = set()
    part_cycle = [p for p in eval_parts]
    turn = 0
    for idx, sentence in enumerate(order):
        if turn >= len(part_cycle) * eval_size:
            break
        words = collections.Counter(sentence.split())
        if all(remaining[w] > n for w, n in words.items()):
            remaining.subtract(words)
            evals[part_cycle[turn % len(part_cycle)]].append(sentence)
            taken.add(idx)
            turn += 1
    short = {p: len(v) for p, v in evals.items() if len(v) < eval_size}
    if short:
        raise ValueError(
            f"not enough sentences for {eval_size} per evaluation part: got {short}; "
            f"use a larger vocabulary or a smaller evaluation size"
        )
    train = [s for i, s in enumerate(order) if i not in taken]
    return TextSplits(train=train, eval=evals, babble=out_of_vocabulary(sentences, vocab))


def out_of_vocabulary(sentences: Sequence[str], vocab: Set[str]) -> List[str]:
    """The sentences with a word outside ``vocab`` (babble material), in order."""
    return [s for s in sentences if not all(w in vocab for w in s.split())]


def babble_sentences(babble_pool: Sequence[str], use: str) -> List[str]:
    """The half of the babble pool reserved for one use, so the two never share text.

    ``use`` is ``"other"`` (noise of the ``-other`` parts) or ``"noise-corpus"``
    (the noise corpus mixed into training).
    """
    halves = {"other": 0, "noise-corpus": 1}
    if use not in halves:
        raise ValueError(f"unknown babble use {use!r}; choose from {sorted(halves)}")
    return list(babble_pool[halves[use] :: 2])


def oov_counts(train_texts: Iterable[str], texts: Iterable[str]) -> Tuple[int, int]:
    """(number of running words of ``texts`` unseen in ``train_texts``, total words)."""
    known = {w for t in train_texts for w in t.split()}
    words = [w for t in texts for w in t.split()]
    return sum(1 for w in words if w not in known), len(words)
