#!/usr/bin/env python3
"""Stage 3 (real LibriSpeech): MUSAN manifests and fbank, as icefall's compute_fbank_musan.py.

    ./local/compute_fbank_musan.py --musan-dir download/musan --nj 8

lhotse's MUSAN manifests (music, speech, noise) go to MANIFEST_DIR; every
recording is cut into 10 s windows, windows of 5 s or less are dropped, and
the rest get 80-dim fbank: FBANK_DIR/musan_cuts.jsonl.gz (features in
FBANK_DIR/musan_feats/), which training mixes into its cuts (--enable-musan).
"""

import argparse
import sys
from pathlib import Path

from icefall_lite.data.musan import MusanError, compute_fbank_musan
from icefall_lite.utils import add_nj_argument, parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--musan-dir",
        type=Path,
        required=True,
        help="the unpacked corpus, with music/, speech/ and noise/ folders of WAVs",
    )
    parser.add_argument("--manifest-dir", type=Path, default=Path("data/manifests"))
    parser.add_argument("--fbank-dir", type=Path, default=Path("data/fbank"))
    add_nj_argument(parser)
    return parser


def main() -> None:
    args = parse_script_args(get_parser())
    try:
        compute_fbank_musan(args.musan_dir, args.manifest_dir, args.fbank_dir, args.nj)
    except MusanError as err:
        sys.exit(f"compute_fbank_musan.py: {err}")


if __name__ == "__main__":
    main()
