#!/usr/bin/env python3
"""Stage 2: 80-dim fbank (lhotse Fbank, LilcomChunkyWriter) for LibriSpeech parts.

    ./local/compute_fbank_librispeech.py --manifest-dir data/manifests \
        --output-dir data/fbank --parts train-clean-100 dev-clean ... \
        --perturb-speed false --nj 2

Writes data/fbank/librispeech_cuts_<part>.jsonl.gz (features in
data/fbank/librispeech_feats_<part>/). With --perturb-speed true the training
parts also get 0.9x and 1.1x copies. Finished parts are skipped.
"""

import argparse
from pathlib import Path

from icefall_lite.data.features import compute_fbank_librispeech
from icefall_lite.data.layout import DEFAULT_PARTS
from icefall_lite.utils import add_nj_argument, parse_script_args, script_parser, str2bool


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--manifest-dir", type=Path, default=Path("data/manifests"))
    parser.add_argument("--output-dir", type=Path, default=Path("data/fbank"))
    parser.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS))
    parser.add_argument("--perturb-speed", type=str2bool, default=False, help="add 0.9x/1.1x copies of train* parts")
    add_nj_argument(parser)
    return parser


def main() -> None:
    args = parse_script_args(get_parser())
    compute_fbank_librispeech(args.manifest_dir, args.output_dir, args.parts, args.nj, args.perturb_speed)


if __name__ == "__main__":
    main()
