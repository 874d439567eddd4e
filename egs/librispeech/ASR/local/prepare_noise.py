#!/usr/bin/env python3
"""Stage 3 (icefall's MUSAN stage): the synthetic noise corpus with features.

    ./local/prepare_noise.py --dl-dir download --size default --nj 2

Makes white/pink/brown noise and TTS babble in DL_DIR/noise/, then
data/manifests/noise_recordings.jsonl.gz and data/fbank/noise_cuts.jsonl.gz
(10 s windows with 80-dim fbank), which the datamodule mixes into training.
"""

import argparse
from pathlib import Path

from icefall_lite.data.synthetic.noise_corpus import NOISE_SIZES, build_noise_audio, prepare_noise_cuts
from icefall_lite.utils import add_nj_argument, parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--dl-dir", type=Path, required=True, help="noise audio goes to DL_DIR/noise")
    parser.add_argument("--manifest-dir", type=Path, default=Path("data/manifests"))
    parser.add_argument("--fbank-dir", type=Path, default=Path("data/fbank"))
    parser.add_argument("--size", choices=sorted(NOISE_SIZES), default="default")
    parser.add_argument("--seed", type=int, default=42)
    add_nj_argument(parser)
    return parser


def main() -> None:
    args = parse_script_args(get_parser())
    noise_dir = build_noise_audio(args.dl_dir, args.size, args.seed, args.nj)
    prepare_noise_cuts(noise_dir, args.manifest_dir, args.fbank_dir)


if __name__ == "__main__":
    main()
