"""The command lines of decode.py and streaming_decode.py: their flags, the checks that name a bad flag, and
the params (flags plus result dir and icefall's suffix) a decoding run starts from. Here rather than in the
scripts so that the tests parse the very same flags; the flags both share are
:mod:`icefall_lite.decoding.decode_run`'s."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from icefall_lite.decoding.constants import DECODING_METHODS, DEFAULT_DECODE_CHUNK_LEN, STREAMING_METHODS
from icefall_lite.decoding.decode_run import (
    add_decoding_arguments,
    add_decoding_method_argument,
    add_num_threads_argument,
    make_suffix,
    validate_decoding_args,
)
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.checkpoint_args import add_checkpoint_arguments
from icefall_lite.utils import AttributeDict, check_positive, script_parser

# --------------------------------------------------------------------------
# decode.py
# --------------------------------------------------------------------------


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """The searches' settings besides ``--beam-size`` (decode.py, pretrained.py): ``--beam``, ``--max-contexts``,
    ``--max-states`` (fast beam search), ``--max-sym-per-frame`` (greedy search) and ``--blank-penalty``."""
    parser.add_argument(
        "--beam",
        type=float,
        default=20.0,
        help="fast_beam_search: log-probability cutoff below the best score, as Kaldi's beam. (default: 20.0)",
    )
    parser.add_argument(
        "--max-contexts",
        type=int,
        default=8,
        help="fast_beam_search: max decoder contexts per utterance and frame. (default: 8)",
    )
    parser.add_argument(
        "--max-states", type=int, default=64, help="fast_beam_search: max states per utterance and frame. (default: 64)"
    )
    parser.add_argument(
        "--max-sym-per-frame",
        type=int,
        default=1,
        help="greedy_search: max symbols per frame (1 uses the batched search). (default: 1)",
    )
    parser.add_argument(
        "--blank-penalty",
        type=float,
        default=0.0,
        help="Subtracted from the blank logit before every search step (icefall's flag); > 0 "
        "makes hypotheses longer (against deletions). (default: 0.0)",
    )


def get_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """decode.py's flags: icefall's decode.py flags plus the model-size and datamodule flags; ``description``
    (the script's docstring) heads ``--help``."""
    parser = script_parser(description)
    add_decoding_method_argument(parser, DECODING_METHODS)
    add_search_arguments(parser)
    add_checkpoint_arguments(parser, epoch=NUM_EPOCHS, avg=AVG, exp_dir=EXP_DIR)
    add_decoding_arguments(parser)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values of decode.py's flags; also resolves
    ``args.test_set_paths``."""
    check_positive(parser, args, ["beam", "max_contexts", "max_states", "max_sym_per_frame"])
    validate_decoding_args(parser, args)


def get_params(args: argparse.Namespace) -> AttributeDict:
    """decode.py's flags plus derived settings: the result dir ``<exp-dir>/<decoding-method>`` and icefall's
    suffix, ``-blank-penalty-<P>`` appended when the penalty is on."""
    params = AttributeDict(vars(args))
    params.exp_dir = Path(args.exp_dir)
    params.res_dir = params.exp_dir / params.decoding_method
    params.suffix = make_suffix(params)
    if params.blank_penalty != 0:
        params.suffix += f"-blank-penalty-{params.blank_penalty}"
    return params


# --------------------------------------------------------------------------
# streaming_decode.py
# --------------------------------------------------------------------------


def get_streaming_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """streaming_decode.py's flags: decode.py's (greedy and modified beam search only), ``--decode-chunk-len``
    and ``--num-threads``; ``description`` (the script's docstring) heads ``--help``."""
    parser = script_parser(description)
    add_decoding_method_argument(parser, STREAMING_METHODS)
    parser.add_argument(
        "--decode-chunk-len",
        type=int,
        default=DEFAULT_DECODE_CHUNK_LEN,
        help="Feature frames between encoder calls, a multiple of 4 (export_onnx.py's flag); every "
        f"call sees decode_chunk_len + 5 frames. (default: {DEFAULT_DECODE_CHUNK_LEN})",
    )
    add_num_threads_argument(parser)
    add_checkpoint_arguments(parser, epoch=NUM_EPOCHS, avg=AVG, exp_dir=EXP_DIR)
    add_decoding_arguments(parser)
    return parser


def validate_streaming_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values of streaming_decode.py's flags; also resolves
    ``args.test_set_paths``."""
    if args.decode_chunk_len < 4 or args.decode_chunk_len % 4:
        parser.error(f"--decode-chunk-len must be a positive multiple of 4, got {args.decode_chunk_len}")
    check_positive(parser, args, ["num_threads"])
    validate_decoding_args(parser, args)


def get_streaming_params(args: argparse.Namespace) -> AttributeDict:
    """streaming_decode.py's flags plus derived settings: the result dir
    ``<exp-dir>/streaming/<decoding-method>`` and decode.py's suffix with ``-decode-chunk-len-<N>``."""
    params = AttributeDict(vars(args))
    params.exp_dir = Path(args.exp_dir)
    params.max_sym_per_frame = 1  # streaming search emits at most one symbol per frame
    params.res_dir = params.exp_dir / "streaming" / params.decoding_method
    params.suffix = f"{make_suffix(params)}-decode-chunk-len-{params.decode_chunk_len}"
    return params
