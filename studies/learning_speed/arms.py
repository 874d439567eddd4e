"""The learning-speed study's arms: which settings make the default model learn fastest on 2 CPU cores.

An arm is one training run of ``train.py`` under a wall-clock budget (``--max-minutes``) with one change
from the defaults of the time the study was set up, decoded with greedy search on test-clean and test-other
with the weights at the end of the budget. Here: the arms and the commands (relative to the recipe folder,
egs/librispeech/ASR) that train and decode each.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from studies.runner import decode_flags


@dataclass(frozen=True)
class StudyArm:
    """One arm: a name, what it changes, and the flags that change it.

    Args:
      name: folder name under the study's exp root (``baseline``, ``no-specaug``).
      change: the change from the defaults, in words, for the table.
      train_flags: extra ``train.py`` flags.
      vocab_size: BPE vocabulary of the arm (None: the default BPE model).
      model_flags: model-size flags, given to both train.py and decode.py.
      seed: ``train.py --seed``.
    """

    name: str
    change: str
    train_flags: Tuple[str, ...] = ()
    vocab_size: Optional[int] = None
    model_flags: Tuple[str, ...] = ()
    seed: int = 42


# The defaults the study started from (train.py's of 2026-11-23, before the
# study changed them), given explicitly to every arm so that the arms mean the
# same after the defaults change: 4 x 256 LSTM layers (cpu preset), BPE 500
# (--base-vocab-size), --max-duration 40, Eve lr 0.003, Eden 1000/4, dropout
# 0.1, layer dropout 0.075, SpecAugment and noise mixing on, --model-warm-step
# 100, step loss ramp, no CTC head, no tail padding, GradientFilter 25,
# clip_grad_norm 5, SpecAugment without time warp (train.py's of then). An
# arm's own flags come after these and override them.
STUDY_DEFAULTS = (
    "--max-duration",
    "40",
    "--optimizer",
    "eve",
    "--base-lr",
    "0.003",
    "--lr-batches",
    "1000",
    "--lr-epochs",
    "4",
    "--dropout",
    "0.1",
    "--layer-dropout",
    "0.075",
    "--enable-spec-aug",
    "true",
    "--spec-aug-time-warp-factor",
    "-1",
    "--enable-musan",
    "true",
    "--model-warm-step",
    "100",
    "--loss-ramp",
    "step",
    "--ctc-loss-scale",
    "0",
    "--tail-pad-frames",
    "0",
    "--grad-filter-threshold",
    "25",
    "--clip-grad-norm",
    "5",
    "--model-preset",
    "cpu",
)

ARMS: List[StudyArm] = [
    StudyArm("baseline", "none (seed 42)"),
    StudyArm("baseline-seed2", "none (seed 2)", seed=2),
    StudyArm("no-specaug", "SpecAugment off", ("--enable-spec-aug", "false")),
    StudyArm("no-noise", "noise mixing off", ("--enable-musan", "false")),
    StudyArm("no-dropout", "dropout 0, layer dropout 0", ("--dropout", "0", "--layer-dropout", "0")),
    StudyArm("ctc", "CTC head, --ctc-loss-scale 0.2", ("--ctc-loss-scale", "0.2")),
    StudyArm("bpe200", "BPE vocabulary 200", vocab_size=200),
    StudyArm("bpe100", "BPE vocabulary 100", vocab_size=100),
    StudyArm("lr-0.006", "--base-lr 0.006", ("--base-lr", "0.006")),
    StudyArm(
        "eden-icefall",
        "Eden --lr-batches 5000 --lr-epochs 10 (icefall's)",
        ("--lr-batches", "5000", "--lr-epochs", "10"),
    ),
    StudyArm("batch-100", "--max-duration 100", ("--max-duration", "100")),
    StudyArm("tail-pad", "--tail-pad-frames 35 in training", ("--tail-pad-frames", "35")),
    StudyArm("warm-300", "--model-warm-step 300", ("--model-warm-step", "300")),
    StudyArm(
        "shallow-wide",
        "3 layers x 384 (no projection)",
        model_flags=(
            "--num-encoder-layers",
            "3",
            "--encoder-dim",
            "384",
            "--rnn-hidden-size",
            "384",
            "--dim-feedforward",
            "1536",
        ),
    ),
    StudyArm("linear-ramp", "--loss-ramp linear (zipformer's warm-up of the loss weights)", ("--loss-ramp", "linear")),
    StudyArm(
        "scaled-adam",
        "ScaledAdam, --base-lr 0.045, its own clipping instead of clip_grad_norm",
        ("--optimizer", "scaled-adam", "--base-lr", "0.045", "--clip-grad-norm", "0"),
    ),
    # The levers that helped beyond the seed spread on their own, together.
    StudyArm(
        "combined",
        "SpecAugment off + dropout 0, layer dropout 0 + BPE 100 (noise mixing kept)",
        ("--enable-spec-aug", "false", "--dropout", "0", "--layer-dropout", "0"),
        vocab_size=100,
    ),
]


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def vocab_size_of(args: argparse.Namespace, arm: StudyArm) -> int:
    """The arm's BPE vocabulary: its own, else ``--base-vocab-size``."""
    return args.base_vocab_size if arm.vocab_size is None else arm.vocab_size


def bpe_model_of(args: argparse.Namespace, arm: StudyArm) -> Path:
    """The arm's BPE model (under the exp root), relative to the work dir."""
    return args.exp_root / f"lang_bpe_{vocab_size_of(args, arm)}" / "bpe.model"


def bpe_command(args: argparse.Namespace, vocab_size: int) -> List[str]:
    """``local/train_bpe_model.py`` training the BPE model of ``vocab_size`` pieces under the exp root."""
    lang_dir = args.exp_root / f"lang_bpe_{vocab_size}"
    return [
        "python",
        "local/train_bpe_model.py",
        "--lang-dir",
        str(lang_dir),
        "--vocab-size",
        str(vocab_size),
        "--supervisions",
        "data/manifests/librispeech_supervisions_train-clean-100.jsonl.gz",
    ]


def train_command(args: argparse.Namespace, arm: StudyArm) -> List[str]:
    """``train.py`` for the arm: the budget, the study's pinned defaults, then the arm's own flags."""
    return (
        [
            "python",
            "lstm_transducer_stateless/train.py",
            "--exp-dir",
            str(args.exp_root / arm.name),
            "--num-epochs",
            "100",
            "--max-minutes",
            f"{args.minutes:g}",
            "--seed",
            str(arm.seed),
            "--bpe-model",
            str(bpe_model_of(args, arm)),
        ]
        + list(STUDY_DEFAULTS)
        + list(arm.train_flags)
        + list(arm.model_flags)
    )


def decode_command(args: argparse.Namespace, arm: StudyArm, last_batch: int) -> List[str]:
    """``decode.py``: greedy search with the weights of checkpoint ``last_batch`` alone."""
    return [
        "python",
        "lstm_transducer_stateless/decode.py",
        "--exp-dir",
        str(args.exp_root / arm.name),
        *decode_flags(last_batch, "greedy_search"),
        "--bpe-model",
        str(bpe_model_of(args, arm)),
        "--model-preset",
        "cpu",
    ] + list(arm.model_flags)
