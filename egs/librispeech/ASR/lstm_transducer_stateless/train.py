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
icefall_lite.train (loss, gradient control, step, epochs, resumption), its
flags icefall_lite.train.cli; this script holds the orchestration.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from icefall_lite.data.bpe import load_bpe_model
from icefall_lite.data.datamodule import CutDataError, LibriSpeechAsrDataModule
from icefall_lite.train.checkpoint import CheckpointError
from icefall_lite.train.cli import get_params, get_parser, parse_args, validate_args
from icefall_lite.train.cuda_graphs import StepGraphs, use_cuda_graphs
from icefall_lite.train.distributed import (
    Placement,
    same_on_all_ranks,
    shared_store_restart_problem,
    spawn_placement,
    threads_per_rank,
    torchrun_placement,
)
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loop import train_epochs
from icefall_lite.train.optim import Eden
from icefall_lite.train.optimizer_state import SecondMomentMonitor
from icefall_lite.train.resume import Resumption, init_from_weights
from icefall_lite.train.rng import fix_random_seed
from icefall_lite.train.sequence_log import SequenceLog, log_path
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
from icefall_lite.train.training import Training
from icefall_lite.utils import setup_logger


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
        sequence_log=SequenceLog(log_path(params.exp_dir, rank, world_size)) if params.log_sequence_gradients else None,
        # From the end of the model's warm-up (2 x --model-warm-step), when the loss weights stop changing.
        graphs=StepGraphs(device, 2 * params.model_warm_step) if use_cuda_graphs(params, device, world_size) else None,
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
    parser = get_parser(__doc__)
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
