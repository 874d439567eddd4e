#!/usr/bin/env python3
"""Train the LSTM transducer (icefall's lstm_transducer_stateless3 recipe, on icefall_lite).

Usage (from egs/librispeech/ASR):

  # CPU, default synthetic corpus, default (cpu) model size
  ./lstm_transducer_stateless/train.py --num-epochs 5 --exp-dir lstm_transducer_stateless/exp

  # GPU, icefall's sizes, 4 GPUs
  ./lstm_transducer_stateless/train.py --world-size 4 --model-preset icefall \
      --num-epochs 40 --max-duration 500 --lr-batches 5000 --lr-epochs 10 --model-warm-step 3000

Rerunning with the same --exp-dir resumes from the newest checkpoint
(or pass --start-epoch / --start-batch explicitly).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from icefall_lite.ablation.tb_reader import TrainingScalarTags
from icefall_lite.data.bpe import DEFAULT_BPE_MODEL
from icefall_lite.train.checkpoint import (
    CheckpointError,
    find_checkpoints,
    load_checkpoint,
    load_checkpoint_file,
    load_state_dict_checked,
    remove_checkpoints,
    save_checkpoint,
    unwrap,
    update_averaged_model,
)
from icefall_lite.nn.clip import (
    ErrorClipByValue,
    adaptive_clip_grad_,
    add_error_clip,
    clip_grad_norm_,
    clip_grad_value_,
    get_total_norm,
)
from icefall_lite.data.datamodule import (
    CutDataError,
    LibriSpeechAsrDataModule,
    filter_cuts,
    require_nonempty,
    set_transform_rng_state,
    transform_rng_state,
)
from icefall_lite.decoding.decode_run import NUM_TAIL_PADDED_FRAMES, pad_tail
from icefall_lite.train.diagnostics import ModelDiagnostics, register_inf_check_hooks
from icefall_lite.nn.encoder import subsampled_length
from icefall_lite.nn.model import (
    add_model_arguments,
    build_transducer,
    check_model_args,
    count_parameters,
    model_config_from_args,
)
from icefall_lite.train.optim import Eden, Eve, ScaledAdam
from recipe_defaults import EXP_DIR, NUM_EPOCHS  # this recipe's defaults (the script's folder is on sys.path)
from icefall_lite.utils import (
    AttributeDict,
    MetricsTracker,
    check_positive,
    progress_bar,
    setup_logger,
    str2bool,
    temp_name,
)

DIAGNOSTICS_BATCHES = 5
# icefall trains on 1-20 s utterances (local/make_corrupted_cuts.py corrupts among the same cuts).
TRAIN_DURATION_RANGE = (1.0, 20.0)
# The TensorBoard tags this script writes; the ablation and the learning-speed study read them through TB_TAGS.
TRAIN_TAG_PREFIX = "train/"
TB_TAGS = TrainingScalarTags(
    loss=f"{TRAIN_TAG_PREFIX}loss",
    simple_loss=f"{TRAIN_TAG_PREFIX}simple_loss",
    pruned_loss=f"{TRAIN_TAG_PREFIX}pruned_loss",
    grad_norm=f"{TRAIN_TAG_PREFIX}grad_norm",
    clip_scale=f"{TRAIN_TAG_PREFIX}clip_scale",
    skipped_steps=f"{TRAIN_TAG_PREFIX}skipped_steps",
    valid_loss=f"{TRAIN_TAG_PREFIX}valid_loss",
    epoch=f"{TRAIN_TAG_PREFIX}epoch",
    grad_filter="grad_filter/layer{layer}/{stat}",
)


# --preset icefall: every training and data setting of icefall's lstm_transducer_stateless3
# (its train.py, get_params() and asr_datamodule.py defaults), by train.py's argparse dest.
# valid_interval depends on --full-libri: icefall_preset() adds it.
ICEFALL_PRESET: Dict[str, Any] = {
    "model_preset": "icefall",  # 12 layers, d_model 512, LSTM hidden 1024 with projection, 84.7 M parameters
    "num_epochs": 40,
    "bpe_model": "data/lang_bpe_500/bpe.model",
    "optimizer_name": "eve",
    "base_lr": 0.003,  # icefall's --initial-lr
    "lr_batches": 5000,
    "lr_epochs": 10,
    "model_warm_step": 3000,
    "loss_ramp": "step",
    "prune_range": 5,
    "lm_scale": 0.25,
    "am_scale": 0.0,
    "simple_loss_scale": 0.5,
    "ctc_loss_scale": 0.0,
    "tail_pad_frames": 0,
    "dropout": 0.1,  # icefall's RNNEncoderLayer: dropout 0.1, layer_dropout 0.075
    "layer_dropout": 0.075,
    "grad_filter_threshold": 25.0,  # --grad-norm-threshold
    "clip_grad_norm": 0.0,  # no gradient clipping
    "average_period": 100,
    "save_every_n": 4000,
    "keep_last_k": 20,
    "log_interval": 50,
    "seed": 42,
    "max_duration": 200.0,
    "bucketing_sampler": True,
    "num_buckets": 30,
    "drop_last": True,
    "shuffle": True,
    "num_workers": 2,
    "enable_spec_aug": True,
    "spec_aug_time_warp_factor": 80,
    "enable_musan": True,
}
PRESETS = ("none", "icefall")


def icefall_preset(full_libri: bool) -> Dict[str, Any]:
    """:data:`ICEFALL_PRESET` with icefall's validation interval: 3000 batches with --full-libri, 800 without
    (as icefall's run() sets it)."""
    return {**ICEFALL_PRESET, "valid_interval": 3000 if full_libri else 800}


def parse_args(parser: argparse.ArgumentParser, argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse the command line; ``--preset icefall`` first replaces the defaults with icefall's
    settings, so flags given on the command line still win (e.g. ``--clip-grad-norm 5`` on top)."""
    known, _ = parser.parse_known_args(argv)
    if known.preset == "icefall":
        parser.set_defaults(**icefall_preset(known.full_libri))
    return parser.parse_args(argv)


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=1, help="Number of processes (GPUs, or CPU processes with gloo).")
    parser.add_argument("--master-port", type=int, default=12354, help="Master port for DDP.")
    parser.add_argument("--tensorboard", type=str2bool, default=True, help="Write TensorBoard scalars to exp-dir/tensorboard.")
    parser.add_argument("--num-epochs", type=int, default=NUM_EPOCHS, help="Number of epochs to train.")
    parser.add_argument(
        "--start-epoch",
        type=int,
        default=1,
        help="Resume from exp-dir/epoch-(N-1).pt when > 1. With --start-epoch 1 and --start-batch 0, "
        "training resumes from the newest checkpoint in exp-dir if there is one.",
    )
    parser.add_argument(
        "--start-batch", type=int, default=0, help="Resume from exp-dir/checkpoint-N.pt when > 0 (overrides --start-epoch)."
    )
    parser.add_argument("--exp-dir", type=Path, default=EXP_DIR, help="Checkpoints, logs, tensorboard.")
    parser.add_argument(
        "--init-from", type=Path, default=None,
        help="Start a new run from the model weights of this checkpoint (as icefall's finetune --finetune-ckpt): "
        "optimizer, learning-rate schedule, loss warm-up and batch counters start afresh. Once exp-dir has "
        "checkpoints of its own, the run resumes from those.",
    )
    parser.add_argument("--bpe-model", type=str, default=DEFAULT_BPE_MODEL, help="sentencepiece model.")
    # dest is not "optimizer": checkpoints store params next to the "optimizer" state.
    parser.add_argument("--optimizer", dest="optimizer_name", choices=["eve", "scaled-adam"], default="eve",
                        help="eve: lstm_transducer_stateless3's Adam variant; scaled-adam: the zipformer recipes' "
                        "ScaledAdam (updates relative to each tensor's size, its own clipping at 2x the median "
                        "gradient norm; zipformer uses --base-lr 0.045 and no --clip-grad-norm).")
    parser.add_argument("--base-lr", type=float, default=0.003, help="Base learning rate of the Eden schedule.")
    parser.add_argument("--lr-batches", type=float, default=1000, help="Eden: batches after which the lr starts to fall (icefall: 5000).")
    parser.add_argument("--lr-epochs", type=float, default=4, help="Eden: epochs after which the lr starts to fall (icefall: 10).")
    parser.add_argument("--model-warm-step", type=int, default=100,
                        help="Batches of model warm-up (icefall: 3000): layer bypass ramps over it, the pruned loss is "
                        "off for the first warm-up, at 0.1 for the second, then 1.0.")
    parser.add_argument("--prune-range", type=int, default=5, help="s_range of the pruned RNN-T loss.")
    parser.add_argument("--lm-scale", type=float, default=0.25, help="lm_only_scale of the smoothed simple loss.")
    parser.add_argument("--am-scale", type=float, default=0.0, help="am_only_scale of the smoothed simple loss.")
    parser.add_argument("--simple-loss-scale", type=float, default=0.5, help="Weight of the simple loss.")
    parser.add_argument("--loss-ramp", choices=["step", "linear"], default="step",
                        help="How the loss weights reach their final values over the warm-up: 'step' is "
                        "lstm_transducer_stateless3's (pruned 0 for the first --model-warm-step batches, 0.1 for "
                        "the second, then 1; simple --simple-loss-scale throughout); 'linear' is the zipformer "
                        "recipes' (over the first --model-warm-step batches, simple 1.0 -> --simple-loss-scale "
                        "and pruned 0.1 -> 1.0, linearly).")
    parser.add_argument("--ctc-loss-scale", type=float, default=0.0,
                        help="Weight of an auxiliary CTC loss on the encoder output (a CTC head as in icefall's "
                        "zipformer recipes, which use 0.2); 0 = no CTC head. The logged 'loss' is the transducer "
                        "loss (simple + pruned), so it compares between runs with and without CTC.")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="Dropout on the encoder layers' LSTM and feed-forward branches (and the CTC head) "
                        "(icefall: 0.1).")
    parser.add_argument("--layer-dropout", type=float, default=0.0,
                        help="Probability, per layer and batch, of nearly bypassing an encoder layer (icefall: 0.075).")
    parser.add_argument("--tail-pad-frames", type=int, default=0,
                        help=f"Append this many frames of log(1e-10) to every training utterance, as decode.py "
                        f"appends {NUM_TAIL_PADDED_FRAMES} before the encoder (0 = none, as icefall's training).")
    parser.add_argument("--seed", type=int, default=42, help="Random seed.")
    parser.add_argument("--print-diagnostics", type=str2bool, default=False,
                        help=f"Accumulate per-module value/gradient statistics over {DIAGNOSTICS_BATCHES} batches, print them and exit.")
    parser.add_argument("--inf-check", type=str2bool, default=False, help="Log modules whose outputs or gradients are non-finite.")
    parser.add_argument("--save-every-n", type=int, default=200, help="Save checkpoint-<batch>.pt every N batches (0 = never).")
    parser.add_argument("--keep-last-k", type=int, default=5, help="Keep only the newest K checkpoint-<batch>.pt (0 = all).")
    parser.add_argument("--average-period", type=int, default=20, help="Update model_avg every N batches.")
    parser.add_argument("--use-fp16", type=str2bool, default=False, help="Mixed precision with a GradScaler (CUDA only).")
    parser.add_argument("--clip-grad-norm", type=float, default=5.0,
                        help="Threshold of the clipping chosen by --clip-type: the max global L2 norm (norm), the max "
                        "|gradient| (value) or lambda (adaptive). 0 = no clipping.")
    parser.add_argument("--clip-type", choices=["norm", "value", "adaptive"], default="norm", help="Clipping flavour.")
    parser.add_argument("--error-clip", type=float, default=0.0,
                        help="Per-variable error clip (Paddle's ErrorClipByValue) during backward: the gradient "
                        "arriving at every encoder layer's output is clamped element-wise to [-VALUE, VALUE] "
                        "before it flows into the layer. 0 = off. Independent of --clip-type.")
    parser.add_argument("--log-interval", type=int, default=20, help="Log training statistics every N batches.")
    parser.add_argument("--valid-interval", type=int, default=0,
                        help="Compute the validation loss every N batches of an epoch (icefall's rule: batch index "
                        "> 0 and divisible by N), and not at the end of the epoch; 0 = once, at the end of every "
                        "epoch.")
    parser.add_argument("--preset", choices=PRESETS, default="none",
                        help="icefall: set every training and data setting to icefall's lstm_transducer_stateless3 "
                        "(README, 'On real LibriSpeech with a GPU', lists them); flags given explicitly still win.")
    parser.add_argument("--max-batches", type=int, default=0,
                        help="Stop after this many training batches in total (0 = no limit); used by the ablation "
                        "to train every arm for the same number of steps.")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="Stop after this many minutes of training (0 = no limit; validation is not counted, "
                        "a resumed run counts the time before the interruption); used by the learning-speed study "
                        "to give every arm the same wall-clock budget.")
    add_model_arguments(parser)
    LibriSpeechAsrDataModule.add_arguments(parser)
    # Sized for the ~3 s utterances of the 3-hour synthetic corpus on a 2-core
    # CPU, as the learning-speed study (RESULTS.md) measured: small batches
    # (more updates; --max-duration 100 learned slower per minute), no
    # SpecAugment and no dropout (both slowed learning within the demo's
    # budget; noise mixing stays on for the noisy test-other). For LibriSpeech
    # on a GPU pass icefall's --max-duration 500 --enable-spec-aug true
    # --spec-aug-time-warp-factor 80 --dropout 0.1 --layer-dropout 0.075.
    parser.set_defaults(max_duration=40.0, spec_aug_time_warp_factor=-1, enable_spec_aug=False)
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
            "feature_dim": 80,
            "subsampling_factor": 4,
            "skipped_steps": 0,
            "skipped_utterances": 0,
            "train_seconds": 0.0,
        }
    )


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad or conflicting values."""
    check_positive(parser, args, ["world_size", "num_epochs", "start_epoch", "prune_range", "average_period"])
    if args.valid_interval < 0:
        parser.error(f"--valid-interval must be >= 0, got {args.valid_interval}")
    if args.start_epoch > args.num_epochs:
        parser.error(f"--start-epoch ({args.start_epoch}) is larger than --num-epochs ({args.num_epochs})")
    if args.start_batch < 0:
        parser.error(f"--start-batch must be >= 0, got {args.start_batch}")
    if args.clip_grad_norm < 0:
        parser.error(f"--clip-grad-norm must be >= 0, got {args.clip_grad_norm}")
    if args.grad_filter_threshold < 0:
        parser.error(f"--grad-filter-threshold must be >= 0, got {args.grad_filter_threshold}")
    for name in ("ctc_loss_scale", "tail_pad_frames", "max_minutes", "error_clip"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("dropout", "layer_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if args.use_fp16 and not torch.cuda.is_available():
        parser.error("--use-fp16 needs a CUDA device; none is available")
    if args.init_from is not None and not Path(args.init_from).is_file():
        parser.error(f"--init-from {args.init_from} does not exist")
    if not Path(args.bpe_model).is_file():
        parser.error(f"--bpe-model {args.bpe_model} does not exist; run prepare.sh (stage 4) first")
    check_model_args(parser, args)


def training_model_config(args: argparse.Namespace, vocab_size: int, blank_id: int = 0) -> Dict[str, Any]:
    """:func:`build_transducer` arguments: the model-size flags plus the training-only ones
    (``--dropout``, ``--layer-dropout``, a CTC head when ``--ctc-loss-scale`` > 0)."""
    config = model_config_from_args(args, vocab_size=vocab_size, blank_id=blank_id)
    config.update(dropout=args.dropout, layer_dropout=args.layer_dropout, use_ctc=args.ctc_loss_scale > 0)
    return config


def make_optimizer(params: AttributeDict, model: nn.Module) -> torch.optim.Optimizer:
    """Eve or ScaledAdam (--optimizer) at --base-lr."""
    if params.optimizer_name == "scaled-adam":
        return ScaledAdam(model.parameters(), lr=params.base_lr, clipping_scale=2.0)
    return Eve(model.parameters(), lr=params.base_lr)


def fix_random_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_rng_state(train_dl=None) -> Dict[str, Any]:
    return {
        "transforms": [] if train_dl is None else transform_rng_state(train_dl),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Dict[str, Any], train_dl=None) -> None:
    if train_dl is not None:
        set_transform_rng_state(train_dl, state["transforms"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def pruned_loss_scale(warmup: float) -> float:
    """icefall's ramp: 0 during the first warm-up, 0.1 during the second, then 1.

    As icefall's, ``warmup == 1.0`` exactly gives 1.0: the validation loss
    (computed at warmup 1.0) is ``simple_loss_scale * simple + pruned``.
    """
    if warmup < 1.0:
        return 0.0
    if 1.0 < warmup < 2.0:
        return 0.1
    return 1.0


def loss_scales(params: AttributeDict, warmup: float) -> Tuple[float, float]:
    """(simple, pruned) loss weights at ``warmup`` (batches / --model-warm-step) under --loss-ramp."""
    if params.loss_ramp == "linear":
        if warmup >= 1.0:
            return params.simple_loss_scale, 1.0
        return 1.0 - warmup * (1.0 - params.simple_loss_scale), 0.1 + 0.9 * warmup
    return params.simple_loss_scale, pruned_loss_scale(warmup)


def compute_loss(
    params: AttributeDict,
    model: nn.Module,
    sp: spm.SentencePieceProcessor,
    batch: Dict[str, Any],
    is_training: bool,
    warmup: float = 1.0,
) -> Tuple[Optional[torch.Tensor], MetricsTracker]:
    """Per-utterance summed loss over the batch.

    The objective is ``simple_scale * simple + pruned_scale * pruned +
    ctc_loss_scale * ctc`` with the first two weights from
    :func:`loss_scales`; ``info["loss"]`` holds its transducer part (the
    first two terms) and ``info["ctc_loss"]`` the CTC loss. Loss per frame
    counts the frames of the utterances, not the tail padding
    (``--tail-pad-frames``). Utterances whose loss is not finite are dropped
    and counted. Returns ``(None, info)`` when no utterance is left.
    """
    device = next(model.parameters()).device
    feature = batch["inputs"].to(device)
    supervisions = batch["supervisions"]
    feature_lens = supervisions["num_frames"].to(device)
    num_frames = feature_lens
    if params.tail_pad_frames > 0:
        feature, feature_lens = pad_tail(feature, feature_lens, params.tail_pad_frames)
    token_ids = sp.encode(list(supervisions["text"]), out_type=int)
    with torch.set_grad_enabled(is_training):
        simple_loss, pruned_loss, ctc_loss, _ = model(
            x=feature,
            x_lens=feature_lens,
            y=token_ids,
            prune_range=params.prune_range,
            am_scale=params.am_scale,
            lm_scale=params.lm_scale,
            warmup=warmup,
        )
        is_finite = torch.isfinite(simple_loss) & torch.isfinite(pruned_loss)
        if ctc_loss is not None:
            is_finite &= torch.isfinite(ctc_loss)
        num_dropped = int((~is_finite).sum())
        info = MetricsTracker()
        info["utterances"] = float(is_finite.sum())
        info["dropped_utterances"] = float(num_dropped)
        if num_dropped:
            cut_ids = [c.id for c, ok in zip(supervisions["cut"], is_finite.tolist()) if not ok] if "cut" in supervisions else []
            logging.warning(f"Dropping {num_dropped} utterance(s) with non-finite loss: {cut_ids}")
        if num_dropped == len(token_ids):
            return None, info
        simple_loss = simple_loss[is_finite].sum()
        pruned_loss = pruned_loss[is_finite].sum()
        simple_scale, pruned_scale = loss_scales(params, warmup)
        loss = simple_scale * simple_loss + pruned_scale * pruned_loss
        info["loss"] = float(loss.detach())
        if ctc_loss is not None:
            ctc_loss = ctc_loss[is_finite].sum()
            info["ctc_loss"] = float(ctc_loss.detach())
            loss = loss + params.ctc_loss_scale * ctc_loss
    info["frames"] = float(subsampled_length(num_frames[is_finite]).sum())
    info["simple_loss"] = float(simple_loss.detach())
    info["pruned_loss"] = float(pruned_loss.detach())
    return loss, info


def clip_gradients(params: AttributeDict, model: nn.Module) -> Tuple[float, float]:
    """Clip as --clip-type/--clip-grad-norm say.

    Returns (pre-clip global L2 norm, clip scale as the ratio of post- to
    pre-clip norm). A non-finite norm is returned as is, with nothing clipped.
    """
    named = [(n, p) for n, p in unwrap(model).named_parameters() if p.grad is not None]
    if params.clip_grad_norm > 0 and params.clip_type == "norm":
        norm = float(clip_grad_norm_(named, params.clip_grad_norm, error_if_nonfinite=False))
        scale = min(1.0, params.clip_grad_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        return norm, scale
    norm = float(get_total_norm([p.grad for _, p in named]))
    if not math.isfinite(norm) or params.clip_grad_norm <= 0:
        return norm, 1.0
    if params.clip_type == "value":
        clip_grad_value_(named, params.clip_grad_norm)
    else:
        # The paper leaves the final classifier layer unclipped.
        adaptive_clip_grad_(named, params.clip_grad_norm, exclude=[n for n, _ in named if "output_linear" in n])
    after = float(get_total_norm([p.grad for _, p in named]))
    return norm, after / norm if norm > 0 else 1.0


def log_filter_stats(model: nn.Module, tb_writer, step: int) -> Dict[str, float]:
    """Per-layer GradientFilter statistics of the last backward, to TensorBoard."""
    stats: Dict[str, float] = {}
    for layer, grad_filter in unwrap(model).encoder.gradient_filters():
        for key, value in grad_filter.stats.as_dict().items():
            stats[f"layer{layer}/{key}"] = value
            if tb_writer is not None:
                tb_writer.add_scalar(TB_TAGS.filter_tag(layer, key), value, step)
    return stats


def compute_validation_loss(
    params: AttributeDict, model: nn.Module, sp: spm.SentencePieceProcessor, valid_dl, world_size: int
) -> MetricsTracker:
    model.eval()
    tot = MetricsTracker()
    with torch.no_grad():
        for batch in valid_dl:
            _, info = compute_loss(params, model, sp, batch, is_training=False)
            tot = tot + info
    if world_size > 1:
        tot.reduce(next(model.parameters()).device)
    model.train()
    return tot


def record_valid_loss(params: AttributeDict, valid_info: MetricsTracker) -> None:
    """``params.valid_loss``, and ``best_valid_loss``/``best_valid_epoch`` when it is the best so far."""
    params.valid_loss = valid_info.per_frame("loss")
    if params.valid_loss < params.best_valid_loss:
        params.best_valid_loss = params.valid_loss
        params.best_valid_epoch = params.cur_epoch


def validate(params: AttributeDict, model: nn.Module, sp: spm.SentencePieceProcessor, valid_dl, world_size: int,
             tb_writer) -> MetricsTracker:
    """The validation loss: logged, written to TensorBoard, kept in ``params.valid_loss`` and, when it is
    the best so far, in ``params.best_valid_loss``/``best_valid_epoch`` (which epoch-N.pt becomes
    best-valid-loss.pt)."""
    valid_info = compute_validation_loss(params, model, sp, valid_dl, world_size)
    record_valid_loss(params, valid_info)
    logging.info(f"Epoch {params.cur_epoch}, global batch {params.batch_idx_train}, validation: "
                 f"{valid_info.per_frame_str()}")
    if tb_writer is not None:
        tb_writer.add_scalar(TB_TAGS.valid_loss, params.valid_loss, params.batch_idx_train)
    return valid_info


def save_progress_checkpoint(
    params: AttributeDict, filename: Path, model, model_avg, optimizer, scheduler, scaler, train_dl, rank: int
) -> None:
    """Rank 0 saves model, model_avg, optimizer, scheduler, scaler, sampler position and RNG states."""
    if rank != 0:
        return
    save_checkpoint(
        filename,
        model=model,
        model_avg=model_avg,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=None if train_dl is None else train_dl.sampler,
        extra={"rng_state": get_rng_state(train_dl)},
    )


def train_step(
    params: AttributeDict,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Eden,
    scaler: Optional[torch.amp.GradScaler],
    sp: spm.SentencePieceProcessor,
    batch: Dict[str, Any],
) -> Tuple[MetricsTracker, float, float]:
    """Forward, backward, clip and update on one batch (``params.batch_idx_train`` already counts it).

    A step whose gradient norm is not finite, or whose batch has no utterance
    with a finite loss, is skipped: no update, counted in
    ``params.skipped_steps`` and logged. Returns (info, pre-clip grad norm, clip scale).
    """
    warmup = params.batch_idx_train / params.model_warm_step
    with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=params.use_fp16):
        loss, info = compute_loss(params, model, sp, batch, is_training=True, warmup=warmup)
    params.skipped_utterances += int(info["dropped_utterances"])
    if loss is None:
        # Keep DDP ranks in step: backward through a zero that touches every parameter.
        loss = sum(p.sum() * 0.0 for p in model.parameters())
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    grad_norm, clip_scale = clip_gradients(params, model)
    # As icefall: the learning rate of update b is Eden's at batch b (set before the step).
    scheduler.step_batch(params.batch_idx_train)
    if not math.isfinite(grad_norm) or info["utterances"] == 0:
        params.skipped_steps += 1
        reason = "no utterance with a finite loss" if info["utterances"] == 0 else f"gradient norm is {grad_norm}"
        logging.warning(
            f"Skipping step at batch {params.batch_idx_train}: {reason} (skipped steps so far: {params.skipped_steps})"
        )
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()
    else:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return info, grad_norm, clip_scale


def budget_spent(params: AttributeDict) -> bool:
    """Whether --max-batches or --max-minutes says training is over."""
    return (params.max_batches > 0 and params.batch_idx_train >= params.max_batches) or (
        params.max_minutes > 0 and params.train_seconds >= 60.0 * params.max_minutes
    )


def train_one_epoch(
    params: AttributeDict,
    model: nn.Module,
    model_avg: Optional[nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Eden,
    scaler: Optional[torch.amp.GradScaler],
    sp: spm.SentencePieceProcessor,
    train_dl,
    valid_dl,
    tb_writer,
    world_size: int,
    rank: int,
    rng_state: Optional[Dict[str, Any]] = None,
    diagnostics: Optional[ModelDiagnostics] = None,
) -> bool:
    """Train one epoch; returns False when --max-batches or --max-minutes stopped training early.

    ``params.train_loss`` is set to the running training loss per frame at the end.
    """
    if budget_spent(params):
        # Resumed at the end of the budget (a run killed between its last checkpoint and the final
        # validation): no more steps; the caller validates and saves.
        logging.info(f"Global batch {params.batch_idx_train}: the --max-batches/--max-minutes budget is spent")
        params.train_loss = params.get("train_loss", float("nan"))
        return False
    model.train()
    tot_loss = MetricsTracker()
    iterator = iter(train_dl)
    if rng_state is not None:
        # Restore after the iterator drew its seed, as in the uninterrupted run.
        set_rng_state(rng_state, train_dl)
    progress = progress_bar(iterator, desc=f"epoch {params.cur_epoch}", disable=rank != 0, dynamic_ncols=True,
                    initial=params.batch_idx_in_epoch, unit="batch")
    last_time = time.time()
    for batch in progress:
        params.batch_idx_train += 1
        params.batch_idx_in_epoch += 1
        batch_size = len(batch["supervisions"]["text"])
        info, grad_norm, clip_scale = train_step(params, model, optimizer, scheduler, scaler, sp, batch)
        filter_stats = log_filter_stats(model, tb_writer if rank == 0 else None, params.batch_idx_train)

        if diagnostics is not None and params.batch_idx_in_epoch >= DIAGNOSTICS_BATCHES:
            diagnostics.print_diagnostics()
            return False

        if rank == 0 and model_avg is not None and params.batch_idx_train % params.average_period == 0:
            update_averaged_model(params.average_period, params.batch_idx_train, model, model_avg)

        tot_loss = tot_loss * (1 - 1 / params.reset_interval) + info
        if rank == 0 and tb_writer is not None:
            step = params.batch_idx_train
            if info["frames"] > 0:
                for key in ("loss", "simple_loss", "pruned_loss", "ctc_loss"):
                    if key in info:
                        tb_writer.add_scalar(f"{TRAIN_TAG_PREFIX}{key}", info[key] / info["frames"], step)
            tb_writer.add_scalar(f"{TRAIN_TAG_PREFIX}learning_rate", scheduler.get_last_lr()[0], step)
            tb_writer.add_scalar(TB_TAGS.grad_norm, grad_norm, step)
            tb_writer.add_scalar(TB_TAGS.clip_scale, clip_scale, step)
            if isinstance(optimizer, ScaledAdam):
                tb_writer.add_scalar(f"{TRAIN_TAG_PREFIX}optimizer_clip_scale", optimizer.last_clipping_scale, step)
            tb_writer.add_scalar(TB_TAGS.skipped_steps, params.skipped_steps, step)
        if rank == 0:
            progress.set_postfix(
                loss=f"{tot_loss.per_frame('loss'):.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", gnorm=f"{grad_norm:.3g}",
                refresh=False,
            )
        if params.batch_idx_train % params.log_interval == 0:
            filtered = [v for k, v in filter_stats.items() if k.endswith("fraction_filtered")]
            logging.info(
                f"Epoch {params.cur_epoch}, batch {params.batch_idx_in_epoch}, global batch {params.batch_idx_train}, "
                f"loss[{info.per_frame_str()}], tot_loss[{tot_loss.per_frame_str()}], batch size: {batch_size}, "
                f"lr: {scheduler.get_last_lr()[0]:.2e}, grad_norm: {grad_norm:.3g}, clip_scale: {clip_scale:.3g}, "
                f"filtered: {(sum(filtered) / len(filtered)) if filtered else 0.0:.3f}, skipped steps: {params.skipped_steps}"
            )
        batch_idx = params.batch_idx_in_epoch - 1  # icefall's 0-based index in the epoch
        if params.valid_interval > 0 and batch_idx > 0 and batch_idx % params.valid_interval == 0:
            validate(params, model, sp, valid_dl, world_size, tb_writer if rank == 0 else None)
        if params.save_every_n > 0 and params.batch_idx_train % params.save_every_n == 0:
            save_progress_checkpoint(
                params, params.exp_dir / f"checkpoint-{params.batch_idx_train}.pt",
                model, model_avg, optimizer, scheduler, scaler, train_dl, rank,
            )
            if rank == 0:
                remove_checkpoints(params.exp_dir, params.keep_last_k)
        now = time.time()
        params.train_seconds += now - last_time
        last_time = now
        if budget_spent(params):
            progress.close()
            params.train_loss = tot_loss.per_frame("loss")
            return False
    progress.close()
    loss_value = tot_loss.per_frame("loss")
    params.train_loss = loss_value
    if loss_value < params.best_train_loss:
        params.best_train_epoch = params.cur_epoch
        params.best_train_loss = loss_value
    return True


def model_checksum(model: nn.Module) -> str:
    """SHA-256 of all parameter bytes: equal on every DDP rank when training is in sync."""
    digest = hashlib.sha256()
    for _, p in sorted(unwrap(model).named_parameters()):
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def resume_checkpoint_path(params: AttributeDict) -> Optional[Path]:
    """The checkpoint to resume from: explicit flags first, else the newest in exp-dir."""
    if params.start_batch > 0:
        return params.exp_dir / f"checkpoint-{params.start_batch}.pt"
    if params.start_epoch > 1:
        return params.exp_dir / f"epoch-{params.start_epoch - 1}.pt"
    candidates: List[Tuple[int, Path]] = []
    for path in list(params.exp_dir.glob("epoch-*.pt")) + find_checkpoints(params.exp_dir):
        try:
            candidates.append((int(load_checkpoint_file(path)["batch_idx_train"]), path))
        except (CheckpointError, KeyError) as e:
            logging.warning(f"Ignoring unusable checkpoint {path}: {e}")
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c[0], c[1].name.startswith("epoch-")))[1]


def remove_interrupted_saves(exp_dir: Path) -> None:
    """Delete the temporary files (``.tmp-<name>.pt``) of checkpoint saves a killed process left."""
    for stale in exp_dir.glob(temp_name(Path("*.pt")).name):
        logging.warning(f"Removing {stale}, left by an interrupted checkpoint save")
        stale.unlink(missing_ok=True)


def init_from_weights(path: Path, model: nn.Module, model_avg: Optional[nn.Module]) -> None:
    """--init-from: ``model`` takes the ``model`` weights of checkpoint ``path`` (a clear error if they do not
    fit); ``model_avg`` starts as their float64 copy, as a fresh run's starts as the initial weights."""
    checkpoint = load_checkpoint_file(path)
    load_state_dict_checked(unwrap(model), checkpoint["model"], f"--init-from {path}")
    if model_avg is not None:
        model_avg.load_state_dict({k: v.to(torch.float64) for k, v in unwrap(model).state_dict().items()})
    logging.info(f"Initialised the model from the weights of {path} (trained {checkpoint.get('batch_idx_train', '?')} "
                 "batches); optimizer, schedule and counters start afresh")


class Resumption:
    """Continuing a run from a checkpoint, all in one place.

    :meth:`load` picks the checkpoint (:func:`resume_checkpoint_path`) and
    loads the weights and the training progress (epoch, batch counters, best
    losses); :meth:`restore_optimizers` loads the optimizer, scheduler and
    grad-scaler states once those exist; :meth:`take_epoch_position` hands the
    first epoch trained the sampler position and RNG states of a run that
    stopped mid-epoch.
    """

    PROGRESS_KEYS = ("batch_idx_train", "best_train_loss", "best_valid_loss", "best_train_epoch",
                     "best_valid_epoch", "skipped_steps", "skipped_utterances", "train_seconds")

    def __init__(self, checkpoint: Dict[str, Any]) -> None:
        self.checkpoint: Optional[Dict[str, Any]] = checkpoint

    @classmethod
    def load(
        cls, params: AttributeDict, model: nn.Module, model_avg: Optional[nn.Module], rank: int
    ) -> Optional["Resumption"]:
        """Load the checkpoint to resume from into ``model``/``model_avg``/``params``; None to start afresh."""
        if rank == 0:
            remove_interrupted_saves(params.exp_dir)
        path = resume_checkpoint_path(params)
        if path is None:
            return None
        logging.info(f"Loading checkpoint {path} (use a fresh --exp-dir to start over)")
        checkpoint = load_checkpoint(path, model, model_avg=model_avg)
        for key in cls.PROGRESS_KEYS:
            if key in checkpoint:
                params[key] = checkpoint[key]
        finished_epoch = checkpoint.get("batch_idx_in_epoch", 0) == 0 or path.name.startswith("epoch-")
        params.cur_epoch = int(checkpoint["cur_epoch"]) + (1 if finished_epoch else 0)
        params.batch_idx_in_epoch = 0 if finished_epoch else int(checkpoint["batch_idx_in_epoch"])
        return cls(checkpoint)

    def restore_optimizers(
        self, optimizer: torch.optim.Optimizer, scheduler: Eden, scaler: Optional[torch.amp.GradScaler]
    ) -> None:
        """Load the optimizer, scheduler and grad-scaler states the checkpoint holds."""
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("grad_scaler", scaler)):
            if obj is not None and self.checkpoint.get(name) is not None:
                obj.load_state_dict(self.checkpoint[name])

    def take_epoch_position(self, params: AttributeDict) -> Optional[Tuple[Optional[Dict], Optional[Dict]]]:
        """``(sampler state, RNG states)`` for the first epoch when the run stopped mid-epoch, else None.

        Answers once: later epochs start from their beginning.
        """
        checkpoint, self.checkpoint = self.checkpoint, None
        if checkpoint is None or params.batch_idx_in_epoch == 0:
            return None
        return checkpoint.get("sampler"), checkpoint.get("rng_state")


class Training(NamedTuple):
    """What every epoch of a run uses."""

    params: AttributeDict
    model: nn.Module
    model_avg: Optional[nn.Module]
    optimizer: torch.optim.Optimizer
    scheduler: Eden
    scaler: Optional[torch.amp.GradScaler]
    sp: spm.SentencePieceProcessor
    valid_dl: Any
    tb_writer: Any
    world_size: int
    rank: int
    diagnostics: Optional[ModelDiagnostics]

    def save(self, filename: Path, train_dl) -> None:
        """:func:`save_progress_checkpoint` of this run (rank 0 only)."""
        save_progress_checkpoint(self.params, filename, self.model, self.model_avg, self.optimizer, self.scheduler,
                                 self.scaler, train_dl, self.rank)

    def add_scalar(self, tag: str, value: float) -> None:
        """A TensorBoard scalar at the current global batch (when TensorBoard is on)."""
        if self.tb_writer is not None:
            self.tb_writer.add_scalar(tag, value, self.params.batch_idx_train)


def init_distributed(params: AttributeDict, rank: int, world_size: int) -> None:
    """Join the DDP process group (nccl on GPUs, gloo on CPUs) when ``world_size > 1``."""
    if world_size <= 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(params.master_port))
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def training_device(rank: int) -> torch.device:
    """GPU ``rank`` if there is CUDA, else the CPU."""
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logging.info(f"Device: {device}")
    return device


def load_bpe_model(params: AttributeDict) -> spm.SentencePieceProcessor:
    """The --bpe-model; sets ``params.blank_id`` and ``params.vocab_size``."""
    sp = spm.SentencePieceProcessor()
    sp.load(str(params.bpe_model))
    params.blank_id = sp.piece_to_id("<blk>")
    params.vocab_size = sp.get_piece_size()
    return sp


def build_models(params: AttributeDict, args: argparse.Namespace, rank: int) -> Tuple[nn.Module, Optional[nn.Module]]:
    """The model of the flags, and on rank 0 its float64 running average ``model_avg``."""
    model_config = training_model_config(args, vocab_size=params.vocab_size, blank_id=params.blank_id)
    params.update({f"model_{k}": v for k, v in model_config.items()})
    model = build_transducer(**model_config)
    params.num_parameters = count_parameters(model)
    logging.info("Training started")
    logging.info(params)
    logging.info(f"Number of model parameters: {params.num_parameters}")
    model_avg = copy.deepcopy(model).to(torch.float64) if rank == 0 else None
    if params.error_clip > 0:
        add_layer_error_clips(model, params.error_clip)
    return model, model_avg


def add_layer_error_clips(model: nn.Module, value: float) -> None:
    """--error-clip: Paddle's ErrorClipByValue on every encoder layer's output. In backward the
    gradient arriving at a layer's output is clamped element-wise to [-value, value] before it flows
    into that layer (and so into every layer below)."""
    clip = ErrorClipByValue(value)
    for layer in unwrap(model).encoder.layers:
        add_error_clip(layer, clip)
    logging.info(f"Error clip {clip} on the outputs of {len(unwrap(model).encoder.layers)} encoder layers")


def place_model(
    params: AttributeDict, model: nn.Module, device: torch.device, rank: int, world_size: int
) -> Tuple[nn.Module, Optional[ModelDiagnostics]]:
    """``model`` on ``device`` with the --inf-check hooks and --print-diagnostics, DDP-wrapped when distributed."""
    model.to(device)
    if params.inf_check:
        register_inf_check_hooks(model)
    diagnostics = ModelDiagnostics(model) if params.print_diagnostics else None
    if world_size > 1:
        model = DDP(model, device_ids=[rank] if device.type == "cuda" else None)
    return model, diagnostics


def load_training_data(librispeech: LibriSpeechAsrDataModule, sp: spm.SentencePieceProcessor):
    """The filtered training cuts and the validation dataloader (an error if either set is empty)."""
    # icefall keeps 1-20 s utterances with at least as many frames as tokens.
    min_duration, max_duration = TRAIN_DURATION_RANGE
    train_cuts = filter_cuts(librispeech.train_cuts(), sp, min_duration=min_duration, max_duration=max_duration, name="train")
    valid_cuts = filter_cuts(librispeech.dev_clean_cuts() + librispeech.dev_other_cuts(), sp, name="valid")
    require_nonempty(train_cuts, "training")
    require_nonempty(valid_cuts, "validation")
    return train_cuts, librispeech.valid_dataloaders(valid_cuts)


def open_tensorboard(params: AttributeDict, rank: int):
    """A SummaryWriter into exp-dir/tensorboard on rank 0 with --tensorboard, else None."""
    if rank != 0 or not params.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(params.exp_dir / "tensorboard"), purge_step=params.batch_idx_train + 1)


def epoch_dataloader(librispeech: LibriSpeechAsrDataModule, train_cuts, epoch: int, sampler_state: Optional[Dict]):
    """The training dataloader of ``epoch``, at the resumed sampler position if there is one."""
    train_dl = librispeech.train_dataloaders(train_cuts)
    train_dl.sampler.set_epoch(epoch - 1)
    if sampler_state is not None:
        train_dl.sampler.load_state_dict(sampler_state)
    return train_dl


def stop_early(t: Training, train_dl) -> None:
    """Validate, log and save ``checkpoint-<batch>.pt`` when --max-batches or --max-minutes stopped training.

    The checkpoint keeps the RNG states of the stop, as if no validation had
    run, so that a run resumed from it continues as the uninterrupted one.
    """
    params = t.params
    rng_at_stop = get_rng_state(train_dl)
    valid_info = compute_validation_loss(params, t.model, t.sp, t.valid_dl, t.world_size)
    set_rng_state(rng_at_stop, train_dl)
    params.valid_loss = valid_info.per_frame("loss")
    logging.info(
        f"Stopped by --max-batches {params.max_batches} / --max-minutes {params.max_minutes} at global "
        f"batch {params.batch_idx_train} after {params.train_seconds:.1f} s of training: train loss "
        f"{params.train_loss:.4f}, validation: {valid_info.per_frame_str()}; saving and stopping."
    )
    t.add_scalar(TB_TAGS.valid_loss, params.valid_loss)
    t.save(params.exp_dir / f"checkpoint-{params.batch_idx_train}.pt", train_dl)


def finish_epoch(t: Training, epoch: int, epoch_start: float) -> None:
    """Validate, log, save ``epoch-<epoch>.pt`` and copy it to the best-loss checkpoints it beats."""
    params = t.params
    if params.valid_interval > 0:
        # icefall's rule: validation every --valid-interval batches only.
        valid_text = f"last validation loss {params.get('valid_loss', float('nan')):.4f} (every {params.valid_interval} batches)"
    else:
        valid_info = compute_validation_loss(params, t.model, t.sp, t.valid_dl, t.world_size)
        record_valid_loss(params, valid_info)
        valid_text = f"validation: {valid_info.per_frame_str()}"
        t.add_scalar(TB_TAGS.valid_loss, params.valid_loss)
    logging.info(
        f"Epoch {epoch} done in {time.time() - epoch_start:.1f} s: train loss {params.train_loss:.4f}, "
        f"{valid_text}, skipped steps {params.skipped_steps}, dropped utterances {params.skipped_utterances}"
    )
    t.add_scalar(f"{TRAIN_TAG_PREFIX}epoch_train_loss", params.train_loss)
    params.batch_idx_in_epoch = 0
    filename = params.exp_dir / f"epoch-{epoch}.pt"
    t.save(filename, None)
    if t.rank == 0:
        if params.best_train_epoch == epoch:
            shutil.copyfile(filename, params.exp_dir / "best-train-loss.pt")
        if params.best_valid_epoch == epoch:
            shutil.copyfile(filename, params.exp_dir / "best-valid-loss.pt")


def train_epochs(t: Training, librispeech: LibriSpeechAsrDataModule, train_cuts, resume: Optional[Resumption]) -> None:
    """Epochs ``params.cur_epoch .. --num-epochs``, or until --max-batches/--max-minutes/--print-diagnostics stop."""
    params = t.params
    for epoch in range(params.cur_epoch, params.num_epochs + 1):
        params.cur_epoch = epoch
        t.scheduler.step_epoch(epoch - 1)
        fix_random_seed(params.seed + epoch - 1)
        position = resume.take_epoch_position(params) if resume is not None else None
        if position is None:
            params.batch_idx_in_epoch = 0
        sampler_state, rng_state = position if position is not None else (None, None)
        train_dl = epoch_dataloader(librispeech, train_cuts, epoch, sampler_state)
        t.add_scalar(TB_TAGS.epoch, epoch)
        epoch_start = time.time()
        finished = train_one_epoch(
            params, t.model, t.model_avg, t.optimizer, t.scheduler, t.scaler, t.sp, train_dl, t.valid_dl,
            t.tb_writer, t.world_size, t.rank, rng_state=rng_state, diagnostics=t.diagnostics,
        )
        if t.diagnostics is not None:
            logging.info("Diagnostics printed; exiting (--print-diagnostics).")
            return
        if not finished:
            stop_early(t, train_dl)
            return
        finish_epoch(t, epoch, epoch_start)


def run(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """Train on one process (rank ``rank`` of ``world_size``): set up, resume if there is a checkpoint, train."""
    params = get_params()
    params.update(vars(args))
    fix_random_seed(params.seed)
    init_distributed(params, rank, world_size)
    setup_logger(params.exp_dir / "log" / "log-train", rank=rank, world_size=world_size)
    device = training_device(rank)
    sp = load_bpe_model(params)
    model, model_avg = build_models(params, args, rank)
    resume = Resumption.load(params, model, model_avg, rank)
    if resume is None and params.init_from is not None:
        init_from_weights(params.init_from, model, model_avg)
    model, diagnostics = place_model(params, model, device, rank, world_size)
    optimizer = make_optimizer(params, model)
    scheduler = Eden(optimizer, params.lr_batches, params.lr_epochs)
    scaler = torch.amp.GradScaler("cuda") if params.use_fp16 else None
    if resume is not None:
        resume.restore_optimizers(optimizer, scheduler, scaler)
    librispeech = LibriSpeechAsrDataModule(args)
    train_cuts, valid_dl = load_training_data(librispeech, sp)
    training = Training(params, model, model_avg, optimizer, scheduler, scaler, sp, valid_dl,
                        open_tensorboard(params, rank), world_size, rank, diagnostics)
    start = time.time()
    train_epochs(training, librispeech, train_cuts, resume)
    logging.info(f"Done. Training took {time.time() - start:.1f} s; skipped steps: {params.skipped_steps}")
    logging.info(f"Model checksum (rank {rank}): {model_checksum(model)}")
    if training.tb_writer is not None:
        training.tb_writer.close()
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = get_parser()
    args = parse_args(parser)
    validate_args(parser, args)
    args.exp_dir = Path(args.exp_dir)
    args.exp_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.world_size > 1:
            mp.spawn(run, args=(args.world_size, args), nprocs=args.world_size, join=True)
        else:
            run(rank=0, world_size=1, args=args)
    except (CheckpointError, CutDataError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
