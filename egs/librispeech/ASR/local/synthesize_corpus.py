#!/usr/bin/env python3
"""Stage 0 (synthetic): build the offline LibriSpeech-layout corpus.

Writes <dl-dir>/LibriSpeech/{train-clean-100,dev-clean,dev-other,test-clean,test-other}
with espeak-ng/flite speech of fortune sentences; see icefall_lite/synth_corpus.py.
Skips (with a log line) when the same corpus is already there.

    ./local/synthesize_corpus.py --dl-dir download --size default --seed 42 --nj 2
"""

import argparse
import logging
from pathlib import Path

from icefall_lite.prep_util import default_num_jobs, setup_logging
from icefall_lite.synth_corpus import SIZES, build_corpus


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dl-dir", type=Path, required=True, help="the corpus goes to DL_DIR/LibriSpeech")
    parser.add_argument("--size", choices=sorted(SIZES), default="default", help="default: ~3 h of training audio; tiny: a few dozen utterances")
    parser.add_argument("--seed", type=int, default=42, help="the corpus is identical for a given seed")
    parser.add_argument("--nj", type=int, default=default_num_jobs(), help="worker processes (default: all cores)")
    return parser.parse_args()


def main() -> None:
    args = get_args()
    setup_logging()
    logging.info(f"{Path(__file__).name}: {vars(args)}")
    build_corpus(args.dl_dir, args.size, args.seed, args.nj)


if __name__ == "__main__":
    main()
