"""icefall's checkpoint flags of the decoding and export scripts:
``--epoch --iter --avg --use-averaged-model --exp-dir``
(read by :func:`icefall_lite.train.averaging.load_weights_from_flags`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from icefall_lite.utils import str2bool


def add_checkpoint_arguments(parser: argparse.ArgumentParser, *, epoch: int, avg: int, exp_dir: Path) -> None:
    """icefall's ``--epoch --iter --avg --use-averaged-model --exp-dir`` (decode.py, streaming_decode.py,
    export_onnx.py) with the recipe's defaults ``epoch`` (its training run's last epoch), ``avg`` and ``exp_dir``."""
    parser.add_argument(
        "--epoch",
        type=int,
        default=epoch,
        help="Use exp-dir/epoch-N.pt (epochs count from 1; the default is the last epoch of "
        f"train.py's default run). Use --avg to average it with earlier epochs. (default: {epoch})",
    )
    parser.add_argument(
        "--iter",
        type=int,
        default=0,
        help="If positive, --epoch is ignored and the checkpoint-<batch>.pt files with batch <= ITER "
        "are used. (default: 0)",
    )
    parser.add_argument(
        "--avg",
        type=int,
        default=avg,
        help="Number of checkpoints to average: consecutive checkpoints ending at the one chosen by "
        f"--epoch or --iter. (default: {avg})",
    )
    parser.add_argument(
        "--use-averaged-model",
        type=str2bool,
        default=True,
        help="Use the average of the model over the batches from epoch-(EPOCH-AVG).pt "
        "(excluded) to epoch-EPOCH.pt, computed from the model_avg of those two checkpoints; "
        "false: the mean of the model entries of the AVG checkpoints. (default: true)",
    )
    parser.add_argument(
        "--exp-dir",
        type=Path,
        default=exp_dir,
        help=f"The experiment dir: checkpoints are read from it, results written below it. (default: {exp_dir})",
    )


def validate_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` naming the flag for a bad ``--iter``, ``--epoch`` or ``--avg``."""
    if args.iter < 0:
        parser.error(f"--iter must be >= 0, got {args.iter}")
    if args.iter == 0 and args.epoch < 1:
        parser.error(f"--epoch must be positive, got {args.epoch}")
    if args.avg < 1:
        parser.error(f"--avg must be positive, got {args.avg}")
