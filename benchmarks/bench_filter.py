#!/usr/bin/env python3
"""Benchmark 3: GradientFilter overhead in a training step.

Two copies of the default model (``--model-preset cpu``) with the same
weights, one built with ``--grad-filter-threshold 25`` (a filter in every
LSTM layer) and one with ``0`` (no filter in the graph), each with its own
optimizer, run the recipe's ``train_step`` (forward, backward, clipping, Eve
step) on the same batches, alternately. The profiler's share of the filter's
own backward in the filtered model's step is reported too: it is the overhead
without the run-to-run noise.

Usage:
  python -m benchmarks.bench_filter
  python -m benchmarks.bench_filter --reps 2 --num-batches 1 --max-duration 10   # a quick look
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

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
from benchmarks.train_setup import (
    TokenTable,
    Trainer,
    add_batch_arguments,
    batch_shape,
    make_batches,
)
from icefall_lite.nn.model import DEFAULT_GRAD_FILTER_THRESHOLD
from icefall_lite.utils import script_parser

GOAL = 0.03


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_GRAD_FILTER_THRESHOLD,
        help=f"Filter threshold of the filtered arm. (default: {DEFAULT_GRAD_FILTER_THRESHOLD:g})",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=24,
        help="Timed training steps per arm, alternating arms (and batches). (default: 24)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=2,
        help="Steps of the filtered arm under torch.profiler for the filter's share. (default: 2)",
    )
    add_batch_arguments(parser)
    add_common_arguments(parser)
    return parser


def filter_share(trainer: Trainer, batches, tokens: TokenTable, steps: int) -> float:
    """Fraction of the profiled step time spent in the GradientFilter's forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            trainer.step(batches[i % len(batches)], tokens)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    in_filter = sum(
        e.cpu_time_total for e in events if e.key in ("_GradientFilterFunction", "_GradientFilterFunctionBackward")
    )
    return in_filter / total if total > 0 else float("nan")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    tokens = TokenTable()
    batches = make_batches(args, tokens)
    arms = {
        f"filter {args.threshold:g}": Trainer(["--grad-filter-threshold", str(args.threshold)], args.vocab_size),
        "no filter (0)": Trainer(["--grad-filter-threshold", "0"], args.vocab_size),
    }
    names = list(arms)
    arms[names[1]].model.load_state_dict(arms[names[0]].model.state_dict())
    for batch in batches:  # warm-up: oneDNN builds its kernels once per shape
        for name in names:
            arms[name].step(batch, tokens)
    times = {name: [] for name in names}
    for rep in range(args.reps):
        batch = batches[rep % len(batches)]
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(lambda: arms[name].step(batch, tokens)))
    ratio = paired_ratio(times[names[0]], times[names[1]])
    share = (
        filter_share(arms[names[0]], batches, tokens, args.profile_steps) if args.profile_steps > 0 else float("nan")
    )
    overhead = ratio - 1.0
    rows = [[name, fmt_ms(median(times[name]))] for name in names]
    rows.append(["filtered / unfiltered", f"{ratio:.4f} ({overhead * 100:+.1f}%)"])
    rows.append(["filter's own forward + backward, share of the filtered step (profiler)", f"{share * 100:.2f}%"])
    table = markdown_table(["arm", "median train_step (ms)"], rows)
    section = Section(
        title="3. GradientFilter overhead in a training step",
        threads=args.threads,
        tables=[table],
        notes=[
            "Default model (--model-preset cpu), the recipe's train_step past warm-up (forward, backward, "
            "clip_grad_norm 5, Eve step) plus reading the filter statistics as the training loop does.",
            f"Batches: {batch_shape(batches)} (random features and tokens with the synthetic corpus's shapes, "
            f"--max-duration {args.max_duration:g}).",
            f"{args.reps} steps per arm, arms alternating (order swapped every step); the ratio is the median of "
            "the per-step ratios.",
            f"Goal <= {GOAL * 100:.0f}%: {'met' if overhead <= GOAL else 'missed'} by the wall-clock ratio "
            f"({overhead * 100:+.1f}%); the profiler share ({share * 100:.2f}%) is the noise-free estimate.",
        ],
    )
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
