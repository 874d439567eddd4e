"""Building a training run: device, process group, BPE model, model and its average, optimizer, data,
TensorBoard. Each function is one step of train.py's ``run``."""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
from typing import Any, Dict, Optional, Tuple

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from icefall_lite.data.datamodule import (
    TRAIN_CUT_DURATION_RANGE,
    LibriSpeechAsrDataModule,
    filter_cuts,
    require_nonempty,
)
from icefall_lite.data.features import NUM_MEL_BINS
from icefall_lite.nn.model import build_transducer, count_parameters, model_config_from_args
from icefall_lite.train.checkpoint import unwrap
from icefall_lite.train.diagnostics import ModelDiagnostics, register_inf_check_hooks
from icefall_lite.train.distributed import DEFAULT_MASTER_PORT, Placement
from icefall_lite.train.grad_control import MODEL_RULES
from icefall_lite.train.optim import Eve, ScaledAdam
from icefall_lite.train.rules import RULE_BY_NAME
from icefall_lite.utils import AttributeDict

OPTIMIZERS = ("eve", "scaled-adam")


def init_distributed(params: AttributeDict, placement: Placement) -> None:
    """Join the DDP process group (nccl on GPUs, gloo on CPUs) when ``placement`` has more than one rank.

    Under torchrun the rank, world size and master address and port come from its environment
    (``init_method="env://"``); the processes of ``--world-size`` meet at ``localhost:--master-port``.
    """
    if not placement.distributed:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if placement.launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://")
    else:
        port = params.master_port if params.master_port is not None else DEFAULT_MASTER_PORT
        dist.init_process_group(
            backend, init_method=f"tcp://localhost:{port}", rank=placement.rank, world_size=placement.world_size
        )


def training_device(local_rank: int) -> torch.device:
    """GPU ``local_rank`` (the process's index on its machine) if there is CUDA, else the CPU."""
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logging.info(f"Device: {device}")
    return device


def training_model_config(args: argparse.Namespace, vocab_size: int, blank_id: int) -> Dict[str, Any]:
    """:func:`build_transducer` arguments: the model flags plus the training-only ones
    (``--dropout``, ``--layer-dropout``, a CTC head when ``--ctc-loss-scale`` > 0) and the gradient controls
    built into the model (:data:`icefall_lite.train.grad_control.MODEL_RULES`: the GradientFilter with its
    ``--grad-filter-mode``, and the recurrent cap)."""
    config = model_config_from_args(args, vocab_size=vocab_size, blank_id=blank_id, num_features=NUM_MEL_BINS)
    config.update(dropout=args.dropout, layer_dropout=args.layer_dropout, use_ctc=args.ctc_loss_scale > 0)
    # build_transducer takes each of these rules by its dest.
    config.update({RULE_BY_NAME[name].dest: getattr(args, RULE_BY_NAME[name].dest) for name in MODEL_RULES})
    config.update(grad_filter_mode=args.grad_filter_mode)
    return config


def build_models(
    params: AttributeDict, args: argparse.Namespace, sp: spm.SentencePieceProcessor, rank: int
) -> Tuple[nn.Module, Optional[nn.Module]]:
    """The model of the flags for the BPE model ``sp``, and on rank 0 its float64 running average ``model_avg``.

    Sets ``params.blank_id``, ``params.vocab_size`` and the model's configuration, and logs the params.
    """
    params.blank_id = sp.piece_to_id("<blk>")
    params.vocab_size = sp.get_piece_size()
    model_config = training_model_config(args, vocab_size=params.vocab_size, blank_id=params.blank_id)
    params.update({f"model_{k}": v for k, v in model_config.items()})
    model = build_transducer(**model_config)
    cap = model_config["recurrent_grad_clip"]
    if cap > 0:
        logging.info(f"Recurrent derivative cap {cap:g} in {model.encoder.num_layers} LSTM layers")
    params.num_parameters = count_parameters(model)
    logging.info("Training started")
    logging.info(params)
    logging.info(f"Number of model parameters: {params.num_parameters}")
    model_avg = copy.deepcopy(model).to(torch.float64) if rank == 0 else None
    return model, model_avg


def place_model(
    params: AttributeDict, model: nn.Module, device: torch.device, world_size: int
) -> Tuple[nn.Module, Optional[ModelDiagnostics]]:
    """``model`` on ``device`` with the --inf-check hooks and --print-diagnostics, DDP-wrapped when distributed."""
    model.to(device)
    if params.inf_check:
        register_inf_check_hooks(model)
    diagnostics = ModelDiagnostics(model) if params.print_diagnostics else None
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, diagnostics


def make_optimizer(params: AttributeDict, model: nn.Module) -> torch.optim.Optimizer:
    """Eve or ScaledAdam (``params.optimizer_name``) at ``params.base_lr``."""
    if params.optimizer_name == "scaled-adam":
        return ScaledAdam(model.parameters(), lr=params.base_lr, clipping_scale=2.0)
    return Eve(model.parameters(), lr=params.base_lr)


def load_training_data(librispeech: LibriSpeechAsrDataModule, sp: spm.SentencePieceProcessor):
    """The filtered training cuts and the validation dataloader (an error if either set is empty)."""
    train_cuts = filter_cuts(librispeech.train_cuts(), sp, TRAIN_CUT_DURATION_RANGE, name="train")
    valid_cuts = filter_cuts(librispeech.valid_cuts(), sp, name="valid")
    require_nonempty(train_cuts, "training")
    require_nonempty(valid_cuts, "validation")
    return train_cuts, librispeech.valid_dataloaders(valid_cuts)


def open_tensorboard(params: AttributeDict, rank: int):
    """A SummaryWriter into exp-dir/tensorboard on rank 0 with --tensorboard, else None."""
    if rank != 0 or not params.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(params.exp_dir / "tensorboard"), purge_step=params.batch_idx_train + 1)


def model_checksum(model: nn.Module) -> str:
    """SHA-256 of all parameter bytes: equal on every DDP rank when training is in sync."""
    digest = hashlib.sha256()
    for _, p in sorted(unwrap(model).named_parameters()):
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
