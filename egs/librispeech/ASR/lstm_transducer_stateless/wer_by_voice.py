#!/usr/bin/env python3
"""WER of a decoding on the synthetic corpus, by voice engine, accent, variant,
noise type and SNR band (from the corpus plan, which size and seed determine).

Usage (from egs/librispeech/ASR, after decode.py):

  ./lstm_transducer_stateless/wer_by_voice.py \\
      lstm_transducer_stateless/exp/greedy_search/recogs-test-other-*.txt

The size and seed are read from the corpus's SYNTHETIC.json (--corpus-dir).
"""

from __future__ import annotations

import sys
from pathlib import Path

from icefall_lite.data.synthetic.corpus import MARKER, SIZES, built_config, plan_corpus
from icefall_lite.decoding.metrics import compute_wer, load_transcripts
from icefall_lite.decoding.voice_report import format_breakdown, wer_by_attribute
from icefall_lite.utils import script_parser


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("recogs", nargs="+", type=Path, help="recogs-*.txt files written by decode.py")
    parser.add_argument(
        "--corpus-dir",
        type=Path,
        default=Path("download/LibriSpeech"),
        help="the synthetic corpus the recogs were decoded from (default: %(default)s)",
    )
    args = parser.parse_args()
    marker = args.corpus_dir / MARKER
    if not marker.is_file():
        parser.exit(1, f"wer_by_voice.py: error: {marker} does not exist: pass --corpus-dir of a synthetic corpus\n")
    config = built_config(args.corpus_dir)
    plan = {u.utt_id: u for u in plan_corpus(SIZES[config["size"]], config["seed"]).utterances}
    for path in args.recogs:
        if not path.is_file():
            parser.exit(1, f"wer_by_voice.py: error: {path} does not exist\n")
        results = load_transcripts(path)
        try:
            table = wer_by_attribute(results, plan)
        except KeyError as e:
            parser.exit(1, f"wer_by_voice.py: error: {path}: {e.args[0]}\n")
        print(
            f"{path}: WER {compute_wer(results).wer:.2f}% over {len(results)} utterances "
            f"(corpus size {config['size']}, seed {config['seed']})\n"
        )
        print(format_breakdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
