#!/usr/bin/env python3
"""Benchmark 9: the training step at 4x subsampling (icefall's, 25 encoder frames per second) against 6x
(``train.py --subsampling-factor 6``, 16.7 per second).

Two copies of the default model (``--model-preset cpu``) with the same
weights (the factor changes no parameter shape, only the time strides of the
frontend's convolutions), each with its own optimizer, run the recipe's
``train_step`` on the same batches, alternately. Reported: the median step
time of each, their paired ratio, the training throughput (seconds of audio
per second of training) and the encoder frames per batch.

Usage:
  python -m benchmarks.bench_subsampling
  python -m benchmarks.bench_subsampling --reps 2 --num-batches 1 --max-duration 10   # a quick look
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence

from benchmarks.common import (
    Section,
    add_common_arguments,
    fmt_ms,
    markdown_table,
    median,
    paired_ratio,
    setup_threads,
)
from benchmarks.train_setup import (
    Batch,
    TokenTable,
    Trainer,
    add_batch_arguments,
    batch_shape,
    make_batches,
    time_alternating,
)
from icefall_lite.nn.encoder import subsampled_length
from icefall_lite.utils import script_parser

FACTORS = (4, 6)


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--reps", type=int, default=24, help="Timed training steps per arm, alternating arms. (default: 24)"
    )
    add_batch_arguments(parser)
    add_common_arguments(parser)
    return parser


def encoder_frames(batch: Batch, factor: int) -> int:
    """Encoder frames the LSTMs run over in ``batch``: the padded length after subsampling, times N."""
    inputs = batch.data["inputs"]
    return int(subsampled_length(inputs.shape[1], factor)) * inputs.shape[0]


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    tokens = TokenTable()
    batches = make_batches(args, tokens)
    arms: Dict[str, Trainer] = {f"{f}x": Trainer(["--subsampling-factor", str(f)], args.vocab_size) for f in FACTORS}
    names = list(arms)
    for name in names[1:]:
        arms[name].model.load_state_dict(arms[names[0]].model.state_dict())
    times, audio = time_alternating(arms, batches, tokens, args.reps)
    rows: List[List[str]] = [
        [
            name,
            f"{median([encoder_frames(b, factor) for b in batches]):.0f}",
            fmt_ms(median(times[name])),
            f"{audio / sum(times[name]):.1f}",
        ]
        for name, factor in zip(names, FACTORS)
    ]
    rows.append(
        [f"{names[0]} / {names[1]} (paired median)", "", f"{paired_ratio(times[names[0]], times[names[1]]):.2f}x", ""]
    )
    table = markdown_table(
        [
            "subsampling",
            "encoder frames per batch (N x T', median)",
            "median train_step (ms)",
            "throughput (s of audio / s)",
        ],
        rows,
    )
    Section(
        title="9. The training step at 4x against 6x subsampling (--subsampling-factor)",
        threads=args.threads,
        tables=[table],
        notes=[
            "Default model (--model-preset cpu) at both factors, same weights; the recipe's train_step past "
            "warm-up (forward, backward, clip_grad_norm 5, Eve step) plus reading the filter statistics as the "
            "training loop does; device cpu.",
            f"Batches: {batch_shape(batches)} (random features and tokens with the synthetic corpus's shapes, "
            f"{args.tokens_per_second:g} tokens per second, --max-duration {args.max_duration:g}).",
            f"{args.reps} steps per arm after one warm-up step per batch, arms alternating (order swapped every "
            "step); the speed-up is the median of the per-step ratios; throughput is the audio of the timed "
            "batches over the summed step times.",
            "The WER reached at equal steps is measured by training (RESULTS.md of the recipe), not here.",
        ],
    ).emit(args.markdown_out)


if __name__ == "__main__":
    main()
