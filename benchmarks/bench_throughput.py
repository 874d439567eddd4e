#!/usr/bin/env python3
"""Benchmark 4: training throughput of the default model.

- Seconds of audio trained per wall-clock second: the recipe's ``train_step``
  (default model, ``--max-duration 40`` batch shapes, filter 25) over
  ``--reps`` steps, median step time.
- Achieved GFLOP/s: FLOPs of one step counted with
  ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions,
  forward and backward) plus the LSTMs counted analytically (oneDNN's fused
  LSTM is invisible to the counter), divided by the median step time; as a
  fraction of the sgemm peak measured on this machine with ``torch.mm`` on
  square float32 matrices (best of ``--gemm-reps``), measured between the
  training steps so both see the same load.
- The top operators by self CPU time from ``torch.profiler`` over a few steps.

Usage:
  python -m benchmarks.bench_throughput
  python -m benchmarks.bench_throughput --reps 2 --num-batches 1 --max-duration 10   # a quick look
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (
    Section,
    add_common_arguments,
    markdown_table,
    median,
    setup_threads,
    timed,
)
from benchmarks.train_setup import (
    Batch,
    TokenTable,
    Trainer,
    add_batch_arguments,
    batch_shape,
    count_parameters,
    lstm_flops_hooks,
    make_batches,
)
from icefall_lite.utils import script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--reps", type=int, default=12, help="Timed training steps. (default: 12)")
    parser.add_argument("--gemm-size", type=int, default=1024, help="n of the n x n sgemm. (default: 1024)")
    parser.add_argument(
        "--gemm-reps",
        type=int,
        default=5,
        help="sgemm calls after each training step; the peak is the best of all. (default: 5)",
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="Steps under torch.profiler. (default: 3)")
    parser.add_argument("--top", type=int, default=12, help="Operators listed in the profile table. (default: 12)")
    add_batch_arguments(parser)
    add_common_arguments(parser)
    return parser


def step_flops(trainer: Trainer, batch: Batch, tokens: TokenTable) -> int:
    """FLOPs of one training step (FlopCounterMode + analytic LSTM FLOPs)."""
    lstm_total, handles = lstm_flops_hooks(trainer.model)
    try:
        with FlopCounterMode(display=False) as counter:
            trainer.step(batch, tokens)
    finally:
        for h in handles:
            h.remove()
    return int(counter.get_total_flops()) + lstm_total[0]


def gemm_gflops(n: int) -> float:
    """GFLOP/s of one n x n x n float32 matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = timed(lambda: torch.mm(a, b))
    return 2 * n**3 / seconds / 1e9


def profile_table(trainer: Trainer, batches: Sequence[Batch], tokens: TokenTable, steps: int, top: int) -> str:
    """Top operators by self CPU time over ``steps`` training steps, as Markdown."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            trainer.step(batches[i % len(batches)], tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [
        [
            f"`{e.key}`",
            e.count // steps,
            f"{e.self_cpu_time_total / steps / 1e3:.1f}",
            f"{100 * e.self_cpu_time_total / total:.1f}%",
        ]
        for e in events[:top]
    ]
    return markdown_table(["operator", "calls per step", "self CPU per step (ms)", "share"], rows)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    tokens = TokenTable()
    batches = make_batches(args, tokens)
    trainer = Trainer([], args.vocab_size)
    for batch in batches:  # warm-up: oneDNN builds its kernels once per shape
        trainer.step(batch, tokens)
    flops = [step_flops(trainer, batch, tokens) for batch in batches]
    step_times: List[float] = []
    audio_rates: List[float] = []
    gflops_rates: List[float] = []
    gemm: List[float] = []
    for rep in range(args.reps):
        i = rep % len(batches)
        seconds = timed(lambda: trainer.step(batches[i], tokens))
        step_times.append(seconds)
        audio_rates.append(batches[i].audio_seconds / seconds)
        gflops_rates.append(flops[i] / seconds / 1e9)
        gemm.extend(gemm_gflops(args.gemm_size) for _ in range(args.gemm_reps))
    peak = max(gemm)
    achieved = median(gflops_rates)
    rows = [
        ["median train_step time", f"{median(step_times) * 1e3:.0f} ms"],
        ["seconds of audio per wall second", f"{median(audio_rates):.1f}"],
        ["FLOPs per step (forward + backward)", f"{sum(flops) / len(flops) / 1e9:.1f} GFLOP"],
        ["achieved", f"{achieved:.1f} GFLOP/s"],
        [
            f"sgemm peak ({args.gemm_size}^3 torch.mm, best of {len(gemm)})",
            f"{peak:.1f} GFLOP/s (median {median(gemm):.1f})",
        ],
        ["achieved / sgemm peak", f"{achieved / peak * 100:.1f}%"],
    ]
    section = Section(
        title="4. Training throughput of the default model",
        threads=args.threads,
        tables=[
            markdown_table(["quantity", "value"], rows),
            profile_table(trainer, batches, tokens, args.profile_steps, args.top),
        ],
        notes=[
            f"Default model (--model-preset cpu, {count_parameters(trainer.model):,} parameters, filter 25), the "
            "recipe's train_step past warm-up plus reading the filter statistics; "
            f"{args.reps} timed steps after one warm-up step per batch.",
            f"Batches: {batch_shape(batches)} (random features and tokens with the synthetic corpus's shapes, "
            f"--max-duration {args.max_duration:g}); data loading is not included.",
            "FLOPs: FlopCounterMode (aten matmuls/convolutions, forward and backward) plus 3x the analytic "
            "forward FLOPs of every LSTM call; element-wise work is not counted.",
            f"Second table: torch.profiler, top operators by self CPU time, averaged over {args.profile_steps} steps.",
        ],
    )
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
