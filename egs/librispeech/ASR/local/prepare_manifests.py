#!/usr/bin/env python3
"""Stage 1: lhotse recording/supervision manifests of LibriSpeech-layout parts.

    ./local/prepare_manifests.py --corpus-dir download/LibriSpeech \
        --output-dir data/manifests --parts train-clean-100 dev-clean ... --nj 2

Writes data/manifests/librispeech_{recordings,supervisions}_<part>.jsonl.gz.
Unreadable or empty FLACs are logged by name, skipped and counted; a
transcript outside A-Z/apostrophe/space is refused with an error naming it.
Logs hours, utterances and the OOV rate of every part.
"""

import argparse
import logging
from pathlib import Path

from icefall_lite.manifests import DEFAULT_PARTS, prepare_librispeech_manifests, report_manifests
from icefall_lite.prep_util import default_num_jobs, setup_logging


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, required=True, help="the LibriSpeech folder")
    parser.add_argument("--output-dir", type=Path, default=Path("data/manifests"))
    parser.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS))
    parser.add_argument("--nj", type=int, default=default_num_jobs(), help="worker processes")
    return parser.parse_args()


def main() -> None:
    args = get_args()
    setup_logging()
    logging.info(f"{Path(__file__).name}: {vars(args)}")
    prepare_librispeech_manifests(args.corpus_dir, args.parts, args.output_dir, args.nj)
    report_manifests(args.output_dir, args.parts)


if __name__ == "__main__":
    main()
