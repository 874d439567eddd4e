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
from pathlib import Path

from icefall_lite.data.layout import DEFAULT_PARTS
from icefall_lite.data.manifests import prepare_librispeech_manifests, report_manifests
from icefall_lite.utils import add_nj_argument, parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--corpus-dir", type=Path, required=True, help="the LibriSpeech folder")
    parser.add_argument("--output-dir", type=Path, default=Path("data/manifests"))
    parser.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS))
    add_nj_argument(parser)
    return parser


def main() -> None:
    args = parse_script_args(get_parser())
    prepare_librispeech_manifests(args.corpus_dir, args.parts, args.output_dir, args.nj)
    report_manifests(args.output_dir, args.parts)


if __name__ == "__main__":
    main()
