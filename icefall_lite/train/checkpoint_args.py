"""icefall's checkpoint flags of the decoding and export scripts:
``--epoch --iter --avg --use-averaged-model --exp-dir``, and ``--checkpoint PATH``
for one model file anywhere (icefall's published ``pretrained.pt``, say)
(read by :func:`icefall_lite.train.averaging.load_weights_from_flags`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from icefall_lite.utils import str2bool


def add_checkpoint_arguments(parser: argparse.ArgumentParser, *, epoch: int, avg: int, exp_dir: Path) -> None:
    """icefall's ``--epoch --iter --avg --use-averaged-model --exp-dir`` (decode.py, streaming_decode.py,
    export_onnx.py) with the recipe's defaults ``epoch`` (its training run's last epoch), ``avg`` and ``exp_dir``,
    and ``--checkpoint``."""
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="A model file in icefall's checkpoint format, anywhere, e.g. icefall's published "
        "exp/pretrained.pt ({'model': state_dict}) or an epoch-N.pt: its 'model' entry is used as it is, "
        "and --epoch, --iter, --avg and --use-averaged-model are not used. Result and export file names "
        "carry the file's name (pretrained.pt -> 'pretrained') instead of epoch-E-avg-A; they are still written "
        "below --exp-dir (--output-dir for export_onnx.py). (default: none)",
    )
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


def validate_checkpoint_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, checkpoint_must_exist: bool = True
) -> None:
    """``parser.error`` naming the flag for a bad ``--iter``, ``--epoch`` or ``--avg``, or (with
    ``checkpoint_must_exist``) a ``--checkpoint`` that is not a file or is empty; a truncated or foreign one
    is reported when it is loaded, as a CheckpointError."""
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is not None:
        if not checkpoint_must_exist:
            return
        if not Path(checkpoint).is_file():
            parser.error(f"--checkpoint {checkpoint} does not exist or is not a file")
        if Path(checkpoint).stat().st_size == 0:
            parser.error(f"--checkpoint {checkpoint} is empty (an interrupted download?)")
        return
    if args.iter < 0:
        parser.error(f"--iter must be >= 0, got {args.iter}")
    if args.iter == 0 and args.epoch < 1:
        parser.error(f"--epoch must be positive, got {args.epoch}")
    if args.avg < 1:
        parser.error(f"--avg must be positive, got {args.avg}")
