#!/usr/bin/env python3
"""Stage 0 (synthetic): build the offline LibriSpeech-layout corpus.

Writes <dl-dir>/LibriSpeech/{train-clean-100,dev-clean,dev-other,test-clean,test-other}
with espeak-ng/flite speech: of fortune sentences (--corpus synthetic, see
icefall_lite/data/synthetic/corpus.py) or of connected digit strings
(--corpus digits, see icefall_lite/data/synthetic/digits.py).
Skips (with a log line) when the same corpus is already there.

    ./local/synthesize_corpus.py --dl-dir download --size default --seed 42 --nj 2
    ./local/synthesize_corpus.py --dl-dir download --corpus digits --nj 2
"""

import argparse
from pathlib import Path

from icefall_lite.data.synthetic.corpus import SIZES, build_corpus
from icefall_lite.data.synthetic.digits import DIGITS_SIZES, build_digits_corpus
from icefall_lite.utils import add_nj_argument, parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--dl-dir", type=Path, required=True, help="the corpus goes to DL_DIR/LibriSpeech")
    parser.add_argument(
        "--corpus",
        choices=("synthetic", "digits"),
        default="synthetic",
        help="synthetic: fortune sentences (2,000-word vocabulary); digits: connected digit strings (ZERO..NINE, OH)",
    )
    parser.add_argument(
        "--size",
        choices=sorted(set(SIZES) | set(DIGITS_SIZES)),
        default="default",
        help="synthetic: default: ~10 h of training audio (288 voices); small: its first 3 h "
        "(48 voices, the same dev/test parts); tiny: a few dozen utterances. digits: "
        f"default ({DIGITS_SIZES['default'].train_utts} training utterances, ~3.3 h, "
        f"{DIGITS_SIZES['default'].train_speakers} voices), tiny, or regime (strings of 4-7 digits and a "
        f"{DIGITS_SIZES['regime'].test_other_utts}-utterance test-other, for studies/regime)",
    )
    parser.add_argument("--seed", type=int, default=42, help="the corpus is identical for a given seed")
    add_nj_argument(parser)
    return parser


def main() -> None:
    parser = get_parser()
    args = parse_script_args(parser)
    if args.corpus == "digits":
        if args.size not in DIGITS_SIZES:
            parser.error(f"--corpus digits has sizes {sorted(DIGITS_SIZES)}, not {args.size!r}")
        build_digits_corpus(args.dl_dir, args.size, args.seed, args.nj)
    else:
        build_corpus(args.dl_dir, args.size, args.seed, args.nj)


if __name__ == "__main__":
    main()
