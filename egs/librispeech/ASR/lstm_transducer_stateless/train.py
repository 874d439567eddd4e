#!/usr/bin/env python3
"""Train the LSTM transducer (icefall's lstm_transducer_stateless3 recipe, on icefall_lite).

Usage (from egs/librispeech/ASR):

  # CPU, default synthetic corpus, default (cpu) model size
  ./lstm_transducer_stateless/train.py --num-epochs 5 --exp-dir lstm_transducer_stateless/exp

  # GPU, icefall's settings (every one: --preset icefall), 4 GPUs
  ./lstm_transducer_stateless/train.py --world-size 4 --preset icefall --max-duration 500

  # The same with torchrun (one machine; for several: --nnodes, --node-rank, --rdzv-* on each)
  torchrun --standalone --nproc-per-node 4 ./lstm_transducer_stateless/train.py --preset icefall --max-duration 500

Rerunning with the same --exp-dir resumes from the newest checkpoint
(or pass --start-epoch / --start-batch explicitly). The training loop is
icefall_lite.train (loss, gradient control, step, epochs, resumption); this
script holds the flags and the orchestration.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from icefall_lite.data.bpe import DEFAULT_BPE_MODEL, load_bpe_model
from icefall_lite.data.datamodule import CutDataError, LibriSpeechAsrDataModule
from icefall_lite.data.features import NUM_MEL_BINS
from icefall_lite.nn.encoder import SUBSAMPLING_FACTOR
from icefall_lite.nn.model import add_model_arguments, check_model_args
from icefall_lite.recipe_defaults import EXP_DIR, NUM_EPOCHS, TRAIN_MAX_DURATION
from icefall_lite.train.args import add_training_arguments, check_training_args
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.train.distributed import (
    DEFAULT_MASTER_PORT,
    LaunchError,
    Placement,
    check_launch,
    same_on_all_ranks,
    shared_store_restart_problem,
    spawn_placement,
    threads_per_rank,
    torchrun_placement,
)
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loop import DIAGNOSTICS_BATCHES, Training, train_epochs
from icefall_lite.train.optim import Eden
from icefall_lite.train.optimizer_state import SecondMomentMonitor
from icefall_lite.train.presets import PRESETS, icefall_preset
from icefall_lite.train.resume import Resumption, init_from_weights
from icefall_lite.train.rng import fix_random_seed
from icefall_lite.train.setup import (
    build_models,
    init_distributed,
    load_training_data,
    make_optimizer,
    model_checksum,
    open_tensorboard,
    place_model,
    training_device,
)
from icefall_lite.utils import AttributeDict, check_positive, setup_logger, str2bool


def parse_args(parser: argparse.ArgumentParser, argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse the command line; ``--preset icefall`` first replaces the defaults with icefall's
    settings, so flags given on the command line still win (e.g. ``--clip-grad-norm 5`` on top)."""
    known, _ = parser.parse_known_args(argv)
    if known.preset == "icefall":
        parser.set_defaults(**icefall_preset(known.full_libri))
    return parser.parse_args(argv)


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    for name in ("start_batch", "valid_interval", "max_minutes"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.init_from is not None and not Path(args.init_from).is_file():
        parser.error(f"--init-from {args.init_from} does not exist")
    if not Path(args.bpe_model).is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    check_training_args(parser, args)
    check_model_args(parser, args)
    LibriSpeechAsrDataModule.check_args(parser, args)


def run(placement: Placement, args: argparse.Namespace) -> None:
    """Train on one process (global rank ``placement.rank`` of ``placement.world_size``): set up, resume if there
    is a checkpoint, train."""
    rank, world_size = placement.rank, placement.world_size
    if placement.distributed:
        torch.set_num_threads(threads_per_rank(placement))
    params = get_params()
    params.update(vars(args))
    fix_random_seed(params.seed)
    init_distributed(params, placement)
    setup_logger(params.exp_dir / "log" / "log-train", rank=rank, world_size=world_size)
    if placement.distributed:
        logging.info(
            f"Rank {rank} of {world_size} ({placement.launcher}), local rank {placement.local_rank} of "
            f"{placement.local_world_size} on {socket.gethostname()}, process id {os.getpid()}, "
            f"{torch.get_num_threads()} CPU thread(s)"
        )
        restart_problem = shared_store_restart_problem()
        if restart_problem is not None and rank == 0:
            logging.warning(f"A restart would fail: {restart_problem}")
    device = training_device(placement.local_rank)
    sp = load_bpe_model(params.bpe_model)
    model, model_avg = build_models(params, args, sp, rank)
    grad_control = GradientControl.from_params(params)
    grad_control.install(model)
    resume = Resumption.load(params, model, model_avg, rank)
    if not same_on_all_ranks(params.batch_idx_train):
        raise CheckpointError(
            f"the ranks did not all resume from the same checkpoint (rank {rank}: batch {params.batch_idx_train}): "
            "--exp-dir must be one directory that every machine of the run shares"
        )
    if resume is None and params.init_from is not None:
        init_from_weights(params.init_from, model, model_avg)
    model, diagnostics = place_model(params, model, device, world_size)
    optimizer = make_optimizer(params, model)
    scheduler = Eden(optimizer, params.lr_batches, params.lr_epochs)
    scaler = torch.amp.GradScaler("cuda") if params.use_fp16 else None
    if resume is not None:
        resume.restore_optimizers(optimizer, scheduler, scaler, grad_control)
    librispeech = LibriSpeechAsrDataModule(args)
    train_cuts, valid_dl = load_training_data(librispeech, sp)
    training = Training(
        params=params,
        model=model,
        model_avg=model_avg,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        grad_control=grad_control,
        sp=sp,
        valid_dl=valid_dl,
        tb_writer=open_tensorboard(params, rank),
        world_size=world_size,
        rank=rank,
        diagnostics=diagnostics,
        second_moment=SecondMomentMonitor(model, optimizer) if rank == 0 else None,
    )
    start = time.time()
    train_epochs(training, librispeech, train_cuts, resume)
    logging.info(f"Done. Training took {time.time() - start:.1f} s; skipped steps: {params.skipped_steps}")
    logging.info(f"Model checksum (rank {rank}): {model_checksum(model)}")
    if training.tb_writer is not None:
        training.flush_log()
        training.tb_writer.close()
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_spawned(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """:func:`run` as rank ``rank`` of the ``world_size`` processes that ``--world-size`` spawns."""
    run(spawn_placement(rank, world_size), args)


def main() -> None:
    parser = get_parser()
    args = parse_args(parser)
    validate_args(parser, args)
    args.exp_dir = Path(args.exp_dir)
    args.exp_dir.mkdir(parents=True, exist_ok=True)
    placement = torchrun_placement()
    try:
        if placement is not None:
            run(placement, args)
        elif args.world_size > 1:
            mp.spawn(run_spawned, args=(args.world_size, args), nprocs=args.world_size, join=True)
        else:
            run(spawn_placement(0, 1), args)
    except (CheckpointError, CutDataError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
