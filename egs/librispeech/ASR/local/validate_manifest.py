#!/usr/bin/env python3
"""Check cut manifests: every cut has a non-empty supervision inside it (unless
--supervised false, for noise cuts), features
whose frame count matches its duration, and an existing feature file.

    ./local/validate_manifest.py data/fbank/librispeech_cuts_dev-clean.jsonl.gz [...]

Exits non-zero with a message naming the first bad cut.
"""

import argparse
import logging
import sys
from pathlib import Path

from icefall_lite.data.features import ManifestError, validate_cut_manifest
from icefall_lite.utils import parse_script_args, script_parser, str2bool


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("manifests", type=Path, nargs="+", help="cut manifests (*.jsonl.gz)")
    parser.add_argument("--supervised", type=str2bool, default=True, help="false for noise cuts (no supervisions)")
    parser.add_argument("--load-features", type=str2bool, default=False, help="also read every feature matrix")
    return parser


def main() -> int:
    args = parse_script_args(get_parser())
    for path in args.manifests:
        try:
            n = validate_cut_manifest(path, args.supervised, args.load_features)
        except (ManifestError, FileNotFoundError) as e:
            logging.error(f"{path}: {e}")
            return 1
        logging.info(f"{path}: {n} cuts OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
