#!/usr/bin/env python3
"""Stage 3 (real LibriSpeech): download and unpack MUSAN (OpenSLR 17) with lhotse's downloader.

    ./local/download_musan.py --dl-dir download

Nothing is downloaded when DL_DIR/musan exists. --url may point at a mirror,
including a local one (file:///path/musan.tar.gz).
"""

import argparse
from pathlib import Path

from icefall_lite.data.musan import MUSAN_URL, download_musan
from icefall_lite.utils import parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--dl-dir", type=Path, required=True, help="musan.tar.gz and DL_DIR/musan go here")
    parser.add_argument("--url", default=MUSAN_URL, help="URL of musan.tar.gz (OpenSLR or a mirror)")
    return parser


def main() -> None:
    args = parse_script_args(get_parser())
    download_musan(args.dl_dir, args.url)


if __name__ == "__main__":
    main()
