#!/usr/bin/env python3
"""Benchmark 2: how the pruned and the full transducer loss grow with T, U and B.

Starting from benchmark 1's problem (B=8, T=200, U=40, V=500, joiner dim 512,
s_range 5), one size at a time is halved and doubled. For every size the two
paths are timed side by side (interleaved repetitions, medians) and their peak
memory is measured as in benchmark 1.

Usage:
  python -m benchmarks.bench_loss_scaling
  python -m benchmarks.bench_loss_scaling --reps 1 --frames 100 200   # a quick look
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple

import torch

from benchmarks.bench_loss import compare, make_problem
from benchmarks.common import (
    Section,
    add_common_arguments,
    fmt_mb,
    fmt_ms,
    markdown_table,
    memory_method,
    setup_threads,
)
from icefall_lite.utils import script_parser


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=8, help="B when B is not the varied size. (default: 8)")
    parser.add_argument("--frames", type=int, default=200, help="T when T is not varied. (default: 200)")
    parser.add_argument("--symbols", type=int, default=40, help="U when U is not varied. (default: 40)")
    parser.add_argument(
        "--vary-frames", type=int, nargs="+", default=[100, 400], help="T values besides the base. (default: 100 400)"
    )
    parser.add_argument(
        "--vary-symbols", type=int, nargs="+", default=[20, 80], help="U values besides the base. (default: 20 80)"
    )
    parser.add_argument(
        "--vary-batch", type=int, nargs="+", default=[4, 16], help="B values besides the base. (default: 4 16)"
    )
    parser.add_argument("--vocab-size", type=int, default=500, help="V. (default: 500)")
    parser.add_argument("--joiner-dim", type=int, default=512, help="Joiner dim. (default: 512)")
    parser.add_argument("--prune-range", type=int, default=5, help="s_range. (default: 5)")
    parser.add_argument("--reps", type=int, default=3, help="Timed repetitions per path and size. (default: 3)")
    add_common_arguments(parser)
    return parser


def sizes(args: argparse.Namespace) -> List[Tuple[str, int, int, int]]:
    """(varied size, B, T, U): the base first, then T, U and B varied one at a time."""
    base = (args.batch_size, args.frames, args.symbols)
    out = [("base", *base)]
    out += [("T", base[0], t, base[2]) for t in sorted(args.vary_frames)]
    out += [("U", base[0], base[1], u) for u in sorted(args.vary_symbols)]
    out += [("B", b, base[1], base[2]) for b in sorted(args.vary_batch)]
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for varied, b, t, u in sizes(args):
        problem = make_problem(b, t, u, args.vocab_size, args.joiner_dim, args.prune_range, device)
        result = compare(problem, args.reps)
        rows.append(
            [
                varied,
                b,
                t,
                u,
                fmt_ms(result.times["pruned"]),
                fmt_ms(result.times["full"]),
                f"{result.time_ratio:.2f}x",
                fmt_mb(result.memory["pruned"]),
                fmt_mb(result.memory["full"]),
                f"{result.memory_ratio:.2f}x",
            ]
        )
        print(rows[-1], flush=True)
        del problem
    table = markdown_table(
        [
            "varied",
            "B",
            "T",
            "U",
            "pruned (ms)",
            "full (ms)",
            "time full/pruned",
            "pruned peak (MiB)",
            "full peak (MiB)",
            "memory full/pruned",
        ],
        rows,
    )
    section = Section(
        title="2. Loss cost against T, U and B (forward + backward)",
        threads=args.threads,
        tables=[table],
        notes=[
            f"V={args.vocab_size}, joiner dim {args.joiner_dim}, s_range {args.prune_range}; paths as in "
            f"benchmark 1; {args.reps} interleaved repetitions per size after one warm-up, medians.",
            "The full path's joiner and loss grow with B * T * (U+1); the pruned path's with B * T * s_range, "
            "plus the simple loss (B * T * V and B * (U+1) * T terms) and the lattice recursion "
            "(T + U Python steps, each batched over B and U).",
            f"Peak memory: {memory_method()}.",
        ],
    )
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
