#!/usr/bin/env python3
"""Make the ablation's corrupted training set: a copy of the training manifest
in which a fraction of the cuts is corrupted deterministically, plus links to
the other manifests (dev, test, noise), so that the output directory works as
train.py's --manifest-dir.

    ./local/make_corrupted_cuts.py --src-dir data/fbank --out-dir data/fbank-corrupted \
        --bpe-model data/lang_bpe_500/bpe.model --fraction 0.02 --method random-text

Methods (icefall_lite/data/corruptions.py): random-text (the transcript becomes
random BPE pieces, --density x the cut's encoder frames), swap-text (another
cut's transcript), scale-features (log-mel features x --scale), truncate (the
first third of the audio), silence (a pause of twice the cut's length),
noise-burst (1 s, 20 dB above the cut's loudest frame), concat (other cuts
appended up to 20 s, with their transcripts), or mix (the last five in equal
shares). New features are written under OUT_DIR/feats; a corrupted cut always
passes train.py's filter. Outputs: OUT_DIR/librispeech_cuts_train-clean-100.jsonl.gz,
OUT_DIR/corrupted_cut_ids.txt, OUT_DIR/corruption.json (settings and per-cut
details) and a marker; a rerun with the same settings does nothing, one with
other settings is refused. Run it from the work dir (feature paths in the
manifests are relative to it).
"""

import argparse
import logging
import sys
from pathlib import Path

import sentencepiece as spm

from icefall_lite.data.corrupt import CORRUPTION_METHODS, CorruptionConfig, CorruptionError, make_corrupted_dir
from icefall_lite.data.datamodule import TRAIN_CUT_DURATION_RANGE
from icefall_lite.utils import parse_script_args, script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    defaults = CorruptionConfig()
    parser.add_argument("--src-dir", type=Path, default=Path("data/fbank"), help="manifest dir of the clean corpus")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the corrupted manifest dir goes")
    parser.add_argument("--bpe-model", type=Path, required=True, help="sentencepiece model (token counts)")
    parser.add_argument("--method", choices=CORRUPTION_METHODS, default=defaults.method, help="how to corrupt a cut")
    parser.add_argument(
        "--fraction",
        type=float,
        default=defaults.fraction,
        help="fraction of the training cuts to corrupt (rounded; at least one cut)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="which cuts, and the random text")
    parser.add_argument(
        "--density", type=float, default=defaults.density, help="random-text: tokens per encoder frame (<= 1)"
    )
    parser.add_argument("--scale", type=float, default=defaults.scale, help="scale-features: the factor")
    return parser


def main() -> int:
    args = parse_script_args(get_parser())
    if not args.bpe_model.is_file():
        logging.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
        return 1
    sp = spm.SentencePieceProcessor()
    sp.load(str(args.bpe_model))
    config = CorruptionConfig(
        method=args.method, fraction=args.fraction, seed=args.seed, density=args.density, scale=args.scale
    )
    try:
        make_corrupted_dir(args.src_dir, args.out_dir, config, sp, TRAIN_CUT_DURATION_RANGE)
    except CorruptionError as e:
        logging.error(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
