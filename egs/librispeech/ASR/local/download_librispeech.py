#!/usr/bin/env python3
"""Stage 0 (real LibriSpeech): download and unpack parts with lhotse's downloader.

    ./local/download_librispeech.py --dl-dir download --parts train-clean-100 dev-clean ...

--base-url may point at a mirror, including a local one (file:///path), laid
out as OpenSLR's resources: <base-url>/12/<part>.tar.gz.
"""

import argparse
from pathlib import Path

from icefall_lite.data.layout import DEFAULT_PARTS
from icefall_lite.data.manifests import OPENSLR_URL, download_librispeech
from icefall_lite.utils import parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--dl-dir", type=Path, required=True, help="archives and DL_DIR/LibriSpeech go here")
    parser.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS), help="LibriSpeech parts")
    parser.add_argument("--base-url", default=OPENSLR_URL, help="OpenSLR resources URL or a mirror")
    return parser


def main() -> None:
    args = parse_script_args(get_parser())
    download_librispeech(args.dl_dir, args.parts, args.base_url)


if __name__ == "__main__":
    main()
