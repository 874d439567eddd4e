"""BPE (sentencepiece unigram) model as icefall's ``local/train_bpe_model.py``.

``data/lang_bpe_<N>/`` receives ``transcript_words.txt`` (the training
transcripts, one per line), ``bpe.model`` and ``tokens.txt`` (``<piece> <id>``
per line).  Ids: ``<blk>`` = 0 and ``<sos/eos>`` = 1 (user-defined symbols),
``<unk>`` = 2; no bos/eos pieces.  Every file is written under a temporary name
and renamed.  When the transcripts are too small for the requested number of
pieces, :class:`VocabSizeError` says the largest size they support.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Iterable, List

import sentencepiece as spm

from icefall_lite.utils import atomic_output, write_text_atomic

# The vocabulary of the default (synthetic) corpus: the learning-speed study
# (RESULTS.md) measured 100 pieces learning faster than 500 on its 2,000
# words. prepare.sh's default for --corpus synthetic; LibriSpeech keeps 500.
DEFAULT_VOCAB_SIZE = 100
DEFAULT_BPE_MODEL = f"data/lang_bpe_{DEFAULT_VOCAB_SIZE}/bpe.model"

BLANK, SOS_EOS, UNK = "<blk>", "<sos/eos>", "<unk>"
SPECIAL_IDS = {BLANK: 0, SOS_EOS: 1, UNK: 2}
_TOO_HIGH_RE = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")


class VocabSizeError(ValueError):
    """The transcripts cannot support the requested vocabulary size."""


def supervision_texts(path: Path) -> List[str]:
    """The ``text`` of every segment of a lhotse supervision manifest (``.jsonl.gz``).

    Read directly (a JSON object per line), so the BPE stage does not import lhotse.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def write_transcript_words(texts: Iterable[str], path: Path) -> int:
    """Write one transcript per line to ``path``; return the number of lines."""
    lines = [t.strip() for t in texts if t.strip()]
    if not lines:
        raise ValueError(f"no transcripts to write to {path}")
    write_text_atomic(path, "".join(f"{t}\n" for t in lines))
    return len(lines)


def train_bpe_model(transcript: Path, lang_dir: Path, vocab_size: int) -> Path:
    """Train ``lang_dir/bpe.model`` on ``transcript``; write ``tokens.txt``; return the model path.

    Raises:
        VocabSizeError: ``vocab_size`` is more than the transcripts support;
            the message gives the largest size that works.
    """
    model_path = lang_dir / "bpe.model"
    lang_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lang_dir, prefix=".tmp-bpe-") as tmp:
        prefix = Path(tmp) / "bpe"
        try:
            spm.SentencePieceTrainer.train(
                input=str(transcript),
                vocab_size=vocab_size,
                model_type="unigram",
                model_prefix=str(prefix),
                input_sentence_size=100000000,
                character_coverage=1.0,
                user_defined_symbols=[BLANK, SOS_EOS],
                unk_id=SPECIAL_IDS[UNK],
                bos_id=-1,
                eos_id=-1,
                minloglevel=2,
            )
        except RuntimeError as e:
            match = _TOO_HIGH_RE.search(str(e))
            if match is None:
                raise
            raise VocabSizeError(
                f"the transcripts in {transcript} support at most {match.group(2)} "
                f"unigram pieces, fewer than --vocab-size {vocab_size}: pass "
                f"--vocab-size {match.group(2)} or less (or use a bigger corpus)"
            ) from None
        with atomic_output(model_path) as out:
            out.write_bytes(prefix.with_suffix(".model").read_bytes())
    sp = load_bpe_model(model_path)
    write_tokens(sp, lang_dir / "tokens.txt")
    logging.info(f"trained {model_path} with {sp.get_piece_size()} pieces")
    return model_path


def load_bpe_model(path: Path) -> spm.SentencePieceProcessor:
    """Load a BPE model and check the special ids (``<blk>``=0, ``<sos/eos>``=1, ``<unk>``=2)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no BPE model at {path}: run prepare.sh stage 4")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    for piece, want in SPECIAL_IDS.items():
        got = sp.piece_to_id(piece)
        if got != want:
            raise ValueError(f"{path}: {piece} has id {got}, expected {want}")
    return sp


def write_tokens(sp: spm.SentencePieceProcessor, path: Path) -> None:
    """``tokens.txt``: ``<piece> <id>`` for every id, as icefall writes it."""
    write_text_atomic(path, "".join(f"{sp.id_to_piece(i)} {i}\n" for i in range(sp.get_piece_size())))
