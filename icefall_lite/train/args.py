"""The flags of a training step (optimizer, schedule, loss, regularization, precision and gradient control),
shared by train.py and the benchmarks that time its step; their one home, with :data:`presets.ICEFALL_PRESET`."""

from __future__ import annotations

import argparse

import torch

from icefall_lite.data.features import NUM_TAIL_PADDED_FRAMES
from icefall_lite.train.cuda_graphs import add_cuda_graphs_argument
from icefall_lite.train.grad_control import add_gradient_control_arguments, check_gradient_control_args
from icefall_lite.train.loss import LOSS_RAMPS
from icefall_lite.train.setup import OPTIMIZERS
from icefall_lite.utils import check_positive, str2bool


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Optimizer and schedule, loss, dropout, fp16 and the gradient-control flags (one per rule of
    :data:`icefall_lite.train.rules.RULES`, the GradientFilter's threshold and mode among them)."""
    group = parser.add_argument_group("training step")
    # dest is not "optimizer": checkpoints store params next to the "optimizer" state.
    group.add_argument(
        "--optimizer",
        dest="optimizer_name",
        choices=OPTIMIZERS,
        default="eve",
        help="eve: lstm_transducer_stateless3's Adam variant; scaled-adam: the zipformer recipes' ScaledAdam "
        "(updates relative to each tensor's size, its own clipping at 2x the median gradient norm; zipformer "
        "uses --base-lr 0.045 and no --clip-grad-norm).",
    )
    group.add_argument("--base-lr", type=float, default=0.003, help="Base learning rate of the Eden schedule.")
    group.add_argument(
        "--lr-batches",
        type=float,
        default=1000,
        help="Eden: batches after which the lr starts to fall (icefall: 5000).",
    )
    group.add_argument(
        "--lr-epochs", type=float, default=4, help="Eden: epochs after which the lr starts to fall (icefall: 10)."
    )
    group.add_argument(
        "--model-warm-step",
        type=int,
        default=100,
        help="Batches of model warm-up (icefall: 3000): layer bypass ramps over it, the pruned loss is off for "
        "the first warm-up, at 0.1 for the second, then 1.0.",
    )
    group.add_argument("--prune-range", type=int, default=5, help="s_range of the pruned RNN-T loss.")
    group.add_argument("--lm-scale", type=float, default=0.25, help="lm_only_scale of the smoothed simple loss.")
    group.add_argument("--am-scale", type=float, default=0.0, help="am_only_scale of the smoothed simple loss.")
    group.add_argument("--simple-loss-scale", type=float, default=0.5, help="Weight of the simple loss.")
    group.add_argument(
        "--loss-ramp",
        choices=LOSS_RAMPS,
        default="step",
        help="How the loss weights reach their final values over the warm-up: 'step' is "
        "lstm_transducer_stateless3's (pruned 0 for the first --model-warm-step batches, 0.1 for the second, "
        "then 1; simple --simple-loss-scale throughout); 'linear' is the zipformer recipes' (over the first "
        "--model-warm-step batches, simple 1.0 -> --simple-loss-scale and pruned 0.1 -> 1.0, linearly).",
    )
    group.add_argument(
        "--ctc-loss-scale",
        type=float,
        default=0.0,
        help="Weight of an auxiliary CTC loss on the encoder output (a CTC head as in icefall's zipformer "
        "recipes, which use 0.2); 0 = no CTC head. The logged 'loss' is the transducer loss (simple + "
        "pruned), so it compares between runs with and without CTC.",
    )
    group.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="Dropout on the encoder layers' LSTM and feed-forward branches (and the CTC head) (icefall: 0.1).",
    )
    group.add_argument(
        "--layer-dropout",
        type=float,
        default=0.0,
        help="Probability, per layer and batch, of nearly bypassing an encoder layer (icefall: 0.075).",
    )
    group.add_argument(
        "--tail-pad-frames",
        type=int,
        default=0,
        help=f"Append this many frames of log(1e-10) to every training utterance, as decode.py appends "
        f"{NUM_TAIL_PADDED_FRAMES} before the encoder (0 = none, as icefall's training).",
    )
    group.add_argument(
        "--delay-penalty",
        type=float,
        default=0.0,
        help="Penalise symbol delay in the simple and pruned losses, to make a streaming model emit symbols "
        "earlier (k2's delay_penalty; icefall's stateless3 flag, see arXiv 2211.00490); applied once the "
        "warm-up is over (batch >= 2 x --model-warm-step), never in validation; 0 = off.",
    )
    group.add_argument(
        "--use-fp16", type=str2bool, default=False, help="Mixed precision with a GradScaler (CUDA only)."
    )
    group.add_argument(
        "--use-bf16",
        type=str2bool,
        default=False,
        help="Mixed precision in bfloat16 (autocast on the training device: a CPU with AVX512-BF16 or AMX, or a "
        "CUDA GPU with bf16; icefall's zipformer flag). Weights, gradients and optimizer state stay float32; "
        "the loss recursions and the GradientFilter's statistics run in float32; no GradScaler is needed.",
    )
    add_cuda_graphs_argument(group)
    add_gradient_control_arguments(parser)


def check_training_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse errors naming the flag for bad values of :func:`add_training_arguments`' flags."""
    check_positive(parser, args, ["prune_range", "model_warm_step"])
    for name in ("ctc_loss_scale", "tail_pad_frames", "delay_penalty"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("dropout", "layer_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if args.use_fp16 and args.use_bf16:
        parser.error("--use-fp16 and --use-bf16 exclude each other; choose one")
    if args.use_fp16 and not torch.cuda.is_available():
        parser.error("--use-fp16 needs a CUDA device; none is available")
    if args.use_bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        parser.error("--use-bf16: this CUDA device has no bfloat16 support; use --use-fp16")
    check_gradient_control_args(parser, args)
