"""export_onnx.py's command line: its flags (checkpoint selection as decode.py's, the output options, the model
sizes) and the checks that name a bad flag. Here rather than in the script so that the tests parse the very
same flags. Imports neither onnx nor onnxruntime."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.decoding.constants import DEFAULT_DECODE_CHUNK_LEN
from icefall_lite.nn.model import add_model_arguments, check_model_args
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.checkpoint_args import add_checkpoint_arguments, validate_checkpoint_args
from icefall_lite.utils import script_parser, str2bool


def get_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """icefall's checkpoint flags (as decode.py), the output options and the model-size flags; ``description``
    (the script's docstring) heads ``--help``."""
    parser = script_parser(description)
    add_checkpoint_arguments(parser, epoch=NUM_EPOCHS, avg=AVG, exp_dir=EXP_DIR)
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="Where to write the ONNX files, tokens.txt and the log. (default: --exp-dir)",
    )
    parser.add_argument(
        "--bpe-model",
        type=Path,
        default=Path(DEFAULT_BPE_MODEL),
        help=f"sentencepiece model. (default: {DEFAULT_BPE_MODEL})",
    )
    parser.add_argument(
        "--decode-chunk-len",
        type=int,
        default=DEFAULT_DECODE_CHUNK_LEN,
        help="Feature frames per encoder call (a multiple of 4); the encoder sees "
        f"decode_chunk_len + 5 frames (T). (default: {DEFAULT_DECODE_CHUNK_LEN})",
    )
    parser.add_argument(
        "--int8",
        type=str2bool,
        default=True,
        help="Also write *.int8.onnx (onnxruntime dynamic quantisation), as icefall does. (default: true)",
    )
    add_model_arguments(parser)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values."""
    validate_checkpoint_args(parser, args)
    if args.decode_chunk_len < 4 or args.decode_chunk_len % 4:
        parser.error(f"--decode-chunk-len must be a positive multiple of 4, got {args.decode_chunk_len}")
    if not args.bpe_model.is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    if args.checkpoint is None and not args.exp_dir.is_dir():
        parser.error(f"--exp-dir {args.exp_dir} does not exist; train first (train.py --exp-dir ...)")
    check_model_args(parser, args)
