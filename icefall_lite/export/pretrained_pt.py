"""export.py's library: the averaged model as one ``exp/pretrained.pt``, ``{"model": state_dict}`` in icefall's
names and nothing else (the file icefall publishes, and what ``--checkpoint`` and pretrained.py read).

The weights are chosen as decode.py chooses them (``--epoch``/``--iter``, ``--avg``, ``--use-averaged-model``,
or ``--checkpoint`` to strip one file, e.g. an ``epoch-N.pt`` with its optimizer state, to its model) and loaded
into the model of the size flags first, so a file that would not load in pretrained.py with the same flags is
refused here.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.nn.model import add_model_arguments, check_model_args
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.checkpoint_args import add_checkpoint_arguments, validate_checkpoint_args
from icefall_lite.utils import atomic_output, script_parser

PRETRAINED_NAME = "pretrained.pt"


def get_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """icefall's export.py flags (checkpoint selection as decode.py's, ``--bpe-model`` for the vocabulary) and
    the model-size flags."""
    parser = script_parser(description)
    add_checkpoint_arguments(parser, epoch=NUM_EPOCHS, avg=AVG, exp_dir=EXP_DIR)
    parser.add_argument(
        "--bpe-model",
        type=Path,
        default=Path(DEFAULT_BPE_MODEL),
        help=f"The BPE model of training (its size is the model's vocabulary). (default: {DEFAULT_BPE_MODEL})",
    )
    add_model_arguments(parser)
    return parser


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag."""
    validate_checkpoint_args(parser, args)
    if not args.bpe_model.is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    if args.checkpoint is None and not args.exp_dir.is_dir():
        parser.error(f"--exp-dir {args.exp_dir} does not exist; train first (train.py --exp-dir ...)")
    check_model_args(parser, args)


def save_pretrained(model: nn.Module, filename: Path) -> None:
    """``{"model": model.state_dict()}`` to ``filename``, written under a temporary name and renamed."""
    with atomic_output(filename) as tmp:
        torch.save({"model": model.state_dict()}, tmp)


__all__ = ["PRETRAINED_NAME", "get_parser", "validate_args", "save_pretrained"]
