#!/usr/bin/env python3
"""Where the deletions of a decoding are: per tenth of the reference, and how
many utterances lose their last words (the hypothesis stops short).

Usage (from egs/librispeech/ASR, after decode.py):

  ./lstm_transducer_stateless/deletion_report.py \\
      lstm_transducer_stateless/exp/modified_beam_search/recogs-test-clean-*.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

from icefall_lite.decoding.metrics import compute_wer, deletion_positions, load_transcripts
from icefall_lite.utils import script_parser


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("recogs", nargs="+", type=Path, help="recogs-*.txt files written by decode.py")
    args = parser.parse_args()
    for path in args.recogs:
        if not path.is_file():
            parser.exit(1, f"deletion_report.py: error: {path} does not exist\n")
        results = load_transcripts(path)
        errors = compute_wer(results)
        pos = deletion_positions(results)
        print(
            f"{path}: {pos.utterances} utterances, WER {errors.wer:.2f}%: {errors.insertions} ins, "
            f"{errors.deletions} del, {errors.substitutions} sub over {errors.ref_words} words"
        )
        share = [f"{100 * n / max(1, pos.deletions):.0f}%" for n in pos.by_tenth]
        print("  deletions per tenth of the reference (first .. last): " + " ".join(share))
        print(
            f"  utterances whose last word is deleted: {pos.final_deleted} of {pos.utterances}; "
            f"words in those trailing runs: {pos.trailing_run} of {pos.deletions} deletions"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
