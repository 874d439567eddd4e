#!/usr/bin/env python3
"""Benchmark 8: the training step in float32 against bfloat16 autocast (``train.py --use-bf16 true``).

Two copies of the default model (``--model-preset cpu``) with the same
weights, one training in float32 and one with ``--use-bf16 true`` (bfloat16
autocast on the training device: the matrix products and the LSTM run in
bfloat16, weights, gradients, optimizer state and the loss recursions stay
float32), each with its own optimizer, run the recipe's ``train_step`` on the
same batches, alternately. Reported: the median step time of each, their
paired ratio, the training throughput (seconds of audio per second of
training) and how far the bf16 losses are from the float32 ones at the same
weights (the first batch, before any step).

Usage:
  python -m benchmarks.bench_precision
  python -m benchmarks.bench_precision --reps 2 --num-batches 1 --max-duration 10   # a quick look
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.common import (
    Section,
    add_common_arguments,
    fmt_ms,
    markdown_table,
    median,
    paired_ratio,
    setup_threads,
    timed,
)
from benchmarks.train_setup import Batch, TokenTable, Trainer, add_batch_arguments, batch_shape, make_batches
from icefall_lite.train.step import mixed_precision
from icefall_lite.utils import script_parser

ARMS: Dict[str, List[str]] = {"float32": [], "bf16 autocast": ["--use-bf16", "true"]}


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--reps", type=int, default=24, help="Timed training steps per arm, alternating arms. (default: 24)"
    )
    add_batch_arguments(parser)
    add_common_arguments(parser)
    return parser


def losses_at_same_weights(trainer: Trainer, batch: Batch, tokens: TokenTable) -> float:
    """Sum of the simple and pruned losses of ``batch`` under the arm's autocast, no step taken."""
    supervisions = batch.data["supervisions"]
    with torch.no_grad(), mixed_precision(trainer.params, next(trainer.model.parameters()).device):
        simple, pruned, _, _ = trainer.model(
            batch.data["inputs"], supervisions["num_frames"], [tokens.ids[t] for t in supervisions["text"]]
        )
    return float(simple.sum() + pruned.sum())


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    tokens = TokenTable()
    batches = make_batches(args, tokens)
    arms = {name: Trainer(flags, args.vocab_size) for name, flags in ARMS.items()}
    names = list(arms)
    for name in names[1:]:
        arms[name].model.load_state_dict(arms[names[0]].model.state_dict())
    loss = {name: losses_at_same_weights(arms[name], batches[0], tokens) for name in names}
    for batch in batches:  # warm-up: oneDNN builds its kernels once per shape and dtype
        for name in names:
            arms[name].step(batch, tokens)
    times: Dict[str, List[float]] = {name: [] for name in names}
    audio = 0.0
    for rep in range(args.reps):
        batch = batches[rep % len(batches)]
        audio += batch.audio_seconds
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(lambda: arms[name].step(batch, tokens)))
    speedup = paired_ratio(times[names[0]], times[names[1]])
    rows = [
        [name, fmt_ms(median(times[name])), f"{audio / sum(times[name]):.1f}", f"{loss[name]:.3f}"] for name in names
    ]
    rows.append(["float32 / bf16 (paired median)", f"{speedup:.2f}x", "", ""])
    table = markdown_table(
        ["arm", "median train_step (ms)", "throughput (s of audio / s)", "simple + pruned loss, batch 1, same weights"],
        rows,
    )
    relative = abs(loss[names[1]] - loss[names[0]]) / abs(loss[names[0]])
    Section(
        title="8. The training step in float32 against bfloat16 autocast (--use-bf16)",
        threads=args.threads,
        tables=[table],
        notes=[
            "Default model (--model-preset cpu), the recipe's train_step past warm-up (forward, backward, "
            "clip_grad_norm 5, Eve step) plus reading the filter statistics as the training loop does; device cpu "
            "(no GPU on this machine: CUDA's bf16/fp16 autocast is not timed here).",
            f"Batches: {batch_shape(batches)} (random features and tokens with the synthetic corpus's shapes, "
            f"--max-duration {args.max_duration:g}).",
            f"{args.reps} steps per arm after one warm-up step per batch, arms alternating (order swapped every "
            "step); the speed-up is the median of the per-step ratios; throughput is the audio of the timed "
            "batches over the summed step times.",
            f"Losses at the same weights differ by {relative:.2e} (relative): bf16 rounds the activations; the "
            "WER reached at equal steps is measured by training (RESULTS.md of the recipe), not here.",
        ],
    ).emit(args.markdown_out)


if __name__ == "__main__":
    main()
