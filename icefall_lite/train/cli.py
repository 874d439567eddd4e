"""train.py's command line: its flags (the script's own, then the training step's, the model's and the data's),
the ``--preset icefall`` defaults, the checks that name a bad flag, and the fixed settings that start a run's
params. Here rather than in the script so that the tests and the benchmarks that build train.py's step parse
the very same flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

import torch

from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.data.datamodule import LibriSpeechAsrDataModule
from icefall_lite.data.features import NUM_MEL_BINS
from icefall_lite.nn.encoder import SUBSAMPLING_FACTOR
from icefall_lite.nn.model import add_model_arguments, check_model_args
from icefall_lite.recipe_defaults import EXP_DIR, NUM_EPOCHS, TRAIN_MAX_DURATION
from icefall_lite.train.args import add_training_arguments, check_training_args
from icefall_lite.train.cuda_graphs import use_cuda_graphs
from icefall_lite.train.distributed import DEFAULT_MASTER_PORT, LaunchError, check_launch, torchrun_placement
from icefall_lite.train.loop import DIAGNOSTICS_BATCHES
from icefall_lite.train.presets import PRESETS, icefall_preset
from icefall_lite.utils import AttributeDict, check_positive, str2bool


def parse_args(parser: argparse.ArgumentParser, argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse the command line; ``--preset icefall`` first replaces the defaults with icefall's
    settings, so flags given on the command line still win (e.g. ``--clip-grad-norm 5`` on top)."""
    known, _ = parser.parse_known_args(argv)
    if known.preset == "icefall":
        parser.set_defaults(**icefall_preset(known.full_libri))
    return parser.parse_args(argv)


def get_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    """train.py's flags; ``description`` (the script's docstring) heads ``--help``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add(
        "--world-size",
        type=int,
        default=1,
        help="Number of processes to spawn on this machine, one per GPU (or CPU processes with gloo). Under "
        "torchrun leave it out: torchrun starts the processes (--nproc-per-node, --nnodes).",
    )
    add(
        "--master-port",
        type=int,
        default=None,
        help=f"Port at which the --world-size processes meet on localhost (default {DEFAULT_MASTER_PORT}). Under "
        "torchrun leave it out: torchrun's --master-port or --rdzv-endpoint sets it.",
    )
    add("--tensorboard", type=str2bool, default=True, help="Write TensorBoard scalars to exp-dir/tensorboard.")
    add("--num-epochs", type=int, default=NUM_EPOCHS, help="Number of epochs to train.")
    add(
        "--start-epoch",
        type=int,
        default=1,
        help="Resume from exp-dir/epoch-(N-1).pt when > 1. With --start-epoch 1 and --start-batch 0, "
        "training resumes from the newest checkpoint in exp-dir if there is one.",
    )
    add(
        "--start-batch",
        type=int,
        default=0,
        help="Resume from exp-dir/checkpoint-N.pt when > 0 (overrides --start-epoch).",
    )
    add("--exp-dir", type=Path, default=EXP_DIR, help="Checkpoints, logs, tensorboard.")
    add(
        "--init-from",
        type=Path,
        default=None,
        help="Start a new run from the model weights of this checkpoint (as icefall's finetune --finetune-ckpt): "
        "optimizer, learning-rate schedule, loss warm-up and batch counters start afresh. Once exp-dir has "
        "checkpoints of its own, the run resumes from those.",
    )
    add("--bpe-model", type=str, default=DEFAULT_BPE_MODEL, help="sentencepiece model.")
    add("--seed", type=int, default=42, help="Random seed.")
    add(
        "--print-diagnostics",
        type=str2bool,
        default=False,
        help=f"Accumulate per-module value/gradient statistics over {DIAGNOSTICS_BATCHES} batches, print them, exit.",
    )
    add("--inf-check", type=str2bool, default=False, help="Log modules whose outputs or gradients are non-finite.")
    add("--save-every-n", type=int, default=200, help="Save checkpoint-<batch>.pt every N batches (0 = never).")
    add("--keep-last-k", type=int, default=5, help="Keep only the newest K checkpoint-<batch>.pt (0 = all).")
    add("--average-period", type=int, default=20, help="Update model_avg every N batches.")
    add("--log-interval", type=int, default=20, help="Log training statistics every N batches.")
    add(
        "--log-sequence-gradients",
        type=str2bool,
        default=False,
        help="Write exp-dir/sequence-gradients.jsonl: per step, the batch's cut ids and, per encoder layer, each "
        "sequence's gradient RMS over the batch median as its GradientFilter measured it (needs a filter: "
        "--grad-filter-threshold > 0; inf observes without acting).",
    )
    add(
        "--valid-interval",
        type=int,
        default=0,
        help="Compute the validation loss every N batches of an epoch (icefall's rule: batch index > 0 and "
        "divisible by N), and not at the end of the epoch; 0 = once, at the end of every epoch.",
    )
    add(
        "--preset",
        choices=PRESETS,
        default="none",
        help="icefall: set every training and data setting to icefall's lstm_transducer_stateless3 (the recipe's "
        "README.md, 'On real LibriSpeech with a GPU', lists them); flags given explicitly still win.",
    )
    add(
        "--max-batches",
        type=int,
        default=0,
        help="Stop after this many training batches in total (0 = no limit); the ablation trains every arm "
        "for the same number of steps.",
    )
    add(
        "--max-minutes",
        type=float,
        default=0.0,
        help="Stop after this many minutes of training (0 = no limit; validation is not counted, a resumed run "
        "counts the time before the interruption); the learning-speed study gives every arm the same budget.",
    )
    add_training_arguments(parser)
    add_model_arguments(parser)
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=TRAIN_MAX_DURATION)
    return parser


def get_params() -> AttributeDict:
    """Fixed settings and training progress, logged at start and stored in checkpoints."""
    return AttributeDict(
        {
            "best_train_loss": float("inf"),
            "best_valid_loss": float("inf"),
            "best_train_epoch": -1,
            "best_valid_epoch": -1,
            "batch_idx_train": 0,
            "cur_epoch": 1,
            "batch_idx_in_epoch": 0,
            "reset_interval": 200,
            "feature_dim": NUM_MEL_BINS,
            "subsampling_factor": SUBSAMPLING_FACTOR,
            "skipped_steps": 0,
            "scaler_backoffs": 0,
            "skipped_utterances": 0,
            "train_seconds": 0.0,
        }
    )


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad or conflicting values."""
    check_positive(parser, args, ["world_size", "num_epochs", "start_epoch", "average_period"])
    try:
        check_launch(args.world_size, num_gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        under_torchrun = torchrun_placement() is not None
    except LaunchError as e:
        parser.error(str(e))
    if under_torchrun and args.master_port is not None:
        parser.error(
            "--master-port is for the processes --world-size spawns; under torchrun leave it out and use "
            "torchrun's --master-port or --rdzv-endpoint"
        )
    if args.start_epoch > args.num_epochs:
        parser.error(f"--start-epoch ({args.start_epoch}) is larger than --num-epochs ({args.num_epochs})")
    if args.log_sequence_gradients and not args.grad_filter_threshold > 0:
        parser.error(
            "--log-sequence-gradients reads the GradientFilter's measurements: set --grad-filter-threshold > 0 "
            "(inf measures without filtering)"
        )
    if args.log_sequence_gradients and not args.return_cuts:
        parser.error("--log-sequence-gradients names the batch's cuts: it needs --return-cuts true")
    for name in ("start_batch", "valid_interval", "max_minutes"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.init_from is not None and not Path(args.init_from).is_file():
        parser.error(f"--init-from {args.init_from} does not exist")
    if not Path(args.bpe_model).is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    if args.cuda_graphs == "true":  # auto decides once the run knows its device
        placement = torchrun_placement()
        world_size = args.world_size if placement is None else placement.world_size
        try:
            use_cuda_graphs(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"), world_size)
        except ValueError as e:
            parser.error(str(e))
    check_training_args(parser, args)
    check_model_args(parser, args)
    LibriSpeechAsrDataModule.check_args(parser, args)
