#!/usr/bin/env python3
"""The WER difference between two decodings of the same test set (B - A), with a
paired bootstrap interval over utterances (icefall_lite/decoding/paired_bootstrap.py).

  ./local/compare_decodings.py \\
      old/exp/modified_beam_search/recogs-test-other-epoch-5-avg-2-*.txt \\
      new/exp/modified_beam_search/recogs-test-other-epoch-5-avg-2-*.txt

The interval covers the choice of test utterances only, not training noise
(another seed of the same system moves WER by more).
"""

from __future__ import annotations

import sys
from pathlib import Path

from icefall_lite.decoding.metrics import load_transcripts
from icefall_lite.decoding.paired_bootstrap import paired_bootstrap
from icefall_lite.utils import check_positive, script_parser


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("recogs_a", type=Path, help="recogs-*.txt of system A (the reference system)")
    parser.add_argument("recogs_b", type=Path, help="recogs-*.txt of system B")
    parser.add_argument("--num-resamples", type=int, default=10000, help="bootstrap resamples (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resampling (default: %(default)s)")
    args = parser.parse_args()
    check_positive(parser, args, ["num_resamples"])
    for path in (args.recogs_a, args.recogs_b):
        if not path.is_file():
            parser.exit(1, f"compare_decodings.py: error: {path} does not exist\n")
    try:
        d = paired_bootstrap(
            load_transcripts(args.recogs_a), load_transcripts(args.recogs_b), args.num_resamples, seed=args.seed
        )
    except ValueError as e:
        parser.exit(1, f"compare_decodings.py: error: {e}\n")
    print(f"A: {args.recogs_a}\nB: {args.recogs_b}")
    print(
        f"WER A {d.wer_a:.2f}%, B {d.wer_b:.2f}%, B - A {d.difference:+.2f} points, "
        f"95% paired bootstrap interval [{d.low:+.2f}, {d.high:+.2f}] over {d.utterances} utterances; "
        f"B better in {100 * d.b_better_fraction:.1f}% of {args.num_resamples} resamples"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
