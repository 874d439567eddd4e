#!/usr/bin/env python3
"""Benchmark 6: the mutual-information recursion, today's fused steps vs the per-op version it replaced.

Every RNN-T loss here reduces to ``mutual_information_recursion`` (a training
step runs it twice, for the simple and the pruned loss, with gradients). It
loops over the S + T + 1 anti-diagonals of the lattice; on a GPU each tensor
op of that loop is a kernel launch, so the loop is launch-bound. The version
of commit ``BASELINE_COMMIT`` ran three ops per diagonal forward and three
backward, one after the other; today's runs both directions in the same
steps, with one add and one logaddexp per step (in float64 since issue 28,
see benchmark 7).

The baseline is read from git (``git show BASELINE_COMMIT:<module>``) and run
next to today's module on the same inputs: the table gives the tensor ops per
call (each a kernel launch on a GPU; views are not counted), interleaved
median times of forward + backward, and the largest difference between the
two versions' scores and gradients (the baseline's float32 rounding: today's
recursion runs in float64).

Usage:
  python -m benchmarks.bench_recursion                      # B=8, U=40, T=200 and two other sizes
  python -m benchmarks.bench_recursion --reps 5 --sizes 8x40x200
"""

from __future__ import annotations

import argparse
import subprocess
import types
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import (
    REPO,
    Section,
    add_common_arguments,
    fmt_ms,
    interleaved_times,
    markdown_table,
    median,
    paired_ratio,
    setup_threads,
)
from icefall_lite.nn import mutual_information
from icefall_lite.nn.mutual_information import make_boundary
from icefall_lite.utils import script_parser

# The last commit with the per-op recursion (three ops per diagonal and direction).
BASELINE_COMMIT = "3dd81744b60386c9b29ec468cac9fcb6a32a1c01"
MODULE_PATH = "icefall_lite/nn/mutual_information.py"
# Ops that only make views (no kernel on a GPU).
VIEW_OPS = {
    "as_strided",
    "select",
    "slice",
    "unbind",
    "view",
    "_unsafe_view",
    "permute",
    "expand",
    "unsqueeze",
    "squeeze",
    "reshape",
    "t",
    "transpose",
    "detach",
    "alias",
    "split",
    "unfold",
    "lift_fresh",
}


def load_baseline(commit: str) -> types.ModuleType:
    """The recursion module as it was at ``commit``, imported from ``git show`` under another name."""
    try:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:{MODULE_PATH}"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        raise SystemExit(
            f"bench_recursion.py: cannot read the baseline {MODULE_PATH} at commit {commit} with git "
            f"({detail.strip()}); "
            "run it in a git clone of the repository with its history (not a shallow clone or an archive)."
        ) from err
    module = types.ModuleType("mutual_information_baseline")
    exec(compile(source, f"{commit[:7]}:{MODULE_PATH}", "exec"), module.__dict__)
    return module


class OpCounter(TorchDispatchMode):
    """Counts the tensor ops dispatched inside the ``with`` block, views excepted."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in VIEW_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make_inputs(batch: int, symbols: int, frames: int, device: torch.device, seed: int = 0) -> Tuple[torch.Tensor, ...]:
    """RNN-T-like px (B, S, T+1) and py (B, S+1, T) log-probs and a boundary with varied lengths."""
    gen = torch.Generator().manual_seed(seed)
    px = torch.randn(batch, symbols, frames + 1, generator=gen).log_softmax(-1).to(device)
    py = torch.randn(batch, symbols + 1, frames, generator=gen).log_softmax(-1).to(device)
    px[:, :, frames] = float("-inf")
    s_lens = torch.randint(max(symbols // 2, 1), symbols + 1, (batch,), generator=gen)
    t_lens = torch.randint(max(frames // 2, 1), frames + 1, (batch,), generator=gen)
    s_lens[0], t_lens[0] = symbols, frames
    return px, py, make_boundary(s_lens, t_lens).to(device)


def forward_backward(module: types.ModuleType, px: torch.Tensor, py: torch.Tensor, boundary: torch.Tensor):
    """Scores and gradients (d sum(scores) / d px, d py) of one call with autograd, as the losses use it."""
    px = px.detach().requires_grad_()
    py = py.detach().requires_grad_()
    scores = module.mutual_information_recursion(px, py, boundary)
    scores.sum().backward()
    return scores.detach(), px.grad, py.grad


def count_ops(fn: Callable[[], object]) -> int:
    with OpCounter() as counter:
        fn()
    return counter.count


def max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        finite = torch.isfinite(x) & torch.isfinite(y)
        if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
            return float("inf")
        worst = max(worst, float((x[finite] - y[finite]).abs().max()) if finite.any() else 0.0)
    return worst


def parse_size(text: str) -> Tuple[int, int, int]:
    try:
        batch, symbols, frames = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxSxT such as 8x40x200, got {text!r}") from None
    if min(batch, symbols, frames) < 1:
        raise argparse.ArgumentTypeError(f"B, S and T must be >= 1, got {text!r}")
    return batch, symbols, frames


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--sizes",
        type=parse_size,
        nargs="+",
        default=[(8, 40, 200), (8, 20, 100), (32, 80, 400)],
        help="Lattices BxSxT (batch, symbols, frames). (default: 8x40x200 8x20x100 32x80x400)",
    )
    parser.add_argument("--reps", type=int, default=9, help="Timed repetitions of each version. (default: 9)")
    parser.add_argument(
        "--baseline-commit",
        default=BASELINE_COMMIT,
        help=f"The commit whose {MODULE_PATH} is the baseline. (default: {BASELINE_COMMIT[:7]})",
    )
    add_common_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    versions: Dict[str, types.ModuleType] = {
        f"per-op ({args.baseline_commit[:7]})": load_baseline(args.baseline_commit),
        "fused (today)": mutual_information,
    }
    base_name, new_name = list(versions)
    rows: List[List[str]] = []
    worst = 0.0
    for batch, symbols, frames in args.sizes:
        px, py, boundary = make_inputs(batch, symbols, frames, device)
        calls = {name: (lambda m=m: forward_backward(m, px, py, boundary)) for name, m in versions.items()}
        worst = max(worst, max_abs_diff(calls[base_name](), calls[new_name]()))
        ops = {name: count_ops(call) for name, call in calls.items()}
        times = interleaved_times(calls, reps=args.reps)
        ratio = paired_ratio(times[base_name], times[new_name])
        size = f"B={batch} S={symbols} T={frames} ({symbols + frames + 1} diagonals)"
        rows.append(
            [
                size,
                f"{ops[base_name]} -> {ops[new_name]}",
                fmt_ms(median(times[base_name])),
                fmt_ms(median(times[new_name])),
                f"{ratio:.2f}x",
            ]
        )
    table = markdown_table(
        [
            "lattice",
            "tensor ops per call (per-op -> fused)",
            f"{base_name} fwd+bwd (ms)",
            f"{new_name} fwd+bwd (ms)",
            "speed-up",
        ],
        rows,
    )
    Section(
        title="6. The mutual-information recursion: fused steps vs per-op (forward + backward)",
        threads=args.threads,
        tables=[table],
        notes=[
            f"mutual_information_recursion with autograd (scores, then backward of their sum), float32 RNN-T-like "
            f"log-probs, per-sequence lengths drawn between half and the full S and T, device {device}. Baseline: "
            f"{MODULE_PATH} at commit {args.baseline_commit} (read with git show), run side by side with today's.",
            "Tensor ops counted with a TorchDispatchMode, views excepted: on a GPU each is a kernel launch, and "
            "their number, not the arithmetic, sets the time of these small per-diagonal ops.",
            f"{args.reps} interleaved repetitions after one warm-up; the speed-up is the median of the "
            "per-repetition ratios.",
            f"Largest difference between the two versions' scores and gradients over all sizes: {worst:.3g} "
            "(the same additions and logaddexps in the same order per cell, but today's in float64: the "
            "difference is the baseline's float32 rounding).",
        ],
    ).emit(args.markdown_out)


if __name__ == "__main__":
    main()
