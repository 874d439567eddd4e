"""Names of the corpus parts and of the manifest files, the one place each is written.

prepare.sh writes ``data/fbank/librispeech_cuts_<part>.jsonl.gz`` (icefall's
name, :func:`librispeech_cuts_path`) for the parts :data:`DEFAULT_PARTS` and
``data/fbank/noise_cuts.jsonl.gz`` (:data:`NOISE_CUTS_NAME`, synthetic corpus) or
``data/fbank/musan_cuts.jsonl.gz`` (:data:`MUSAN_CUTS_NAME`, LibriSpeech); the datamodule,
the corrupted training set and the decoding scripts read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

TRAIN_PART = "train-clean-100"
EVAL_PARTS = ("dev-clean", "dev-other", "test-clean", "test-other")
# The parts prepare.sh downloads (LibriSpeech) or synthesizes, training part first.
DEFAULT_PARTS = (TRAIN_PART,) + EVAL_PARTS
# Mini LibriSpeech (OpenSLR 31, icefall's --mini-libri): a 5-hour training part and a 2-hour dev part,
# which serves for validation and as the test set (it has no other).
MINI_TRAIN_PART = "train-clean-5"
MINI_DEV_PART = "dev-clean-2"
# LibriSpeech's training parts and their utterance counts (mux weights for --full-libri).
FULL_TRAIN_PARTS: Dict[str, int] = {"train-clean-100": 28539, "train-clean-360": 104014, "train-other-500": 148688}

CUTS_PREFIX = "librispeech_cuts_"
CUTS_SUFFIX = ".jsonl.gz"
NOISE_CUTS_NAME = "noise_cuts.jsonl.gz"  # the synthetic noise corpus (MUSAN's stand-in)
MUSAN_CUTS_NAME = "musan_cuts.jsonl.gz"  # real MUSAN (icefall's name); mixed in instead when present


def librispeech_cuts_name(part: str) -> str:
    """``librispeech_cuts_<part>.jsonl.gz``: the cut manifest of one part (icefall's name)."""
    return f"{CUTS_PREFIX}{part}{CUTS_SUFFIX}"


def librispeech_cuts_path(fbank_dir: Path, part: str) -> Path:
    """``<fbank_dir>/librispeech_cuts_<part>.jsonl.gz``."""
    return Path(fbank_dir) / librispeech_cuts_name(part)
