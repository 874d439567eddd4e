"""Measurements on a CUDA GPU shared by the GPU check and the GPU step benchmark: one loss call's closure,
the host synchronisations inside a block, and the kernels of one call with the GPU's busy time."""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, Tuple

import torch

from icefall_lite.nn.rnnt_loss import (
    do_rnnt_pruning,
    get_rnnt_prune_ranges,
    make_boundary,
    rnnt_loss_pruned,
    rnnt_loss_smoothed,
)


def random_lattice(
    device: torch.device, shape: Tuple[int, int, int, int], seed: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lm (B, S+1, V), am (B, T, V), symbols (B, S), boundary (B, 4))`` of ``shape = (B, T, S, V)``: random
    normal projections (leaves that require grad), random non-blank symbols, every utterance full length."""
    B, T, S, V = shape
    gen = torch.Generator().manual_seed(seed)
    lm = torch.randn(B, S + 1, V, generator=gen).to(device).requires_grad_(True)
    am = torch.randn(B, T, V, generator=gen).to(device).requires_grad_(True)
    symbols = torch.randint(1, V, (B, S), generator=gen).to(device)
    boundary = make_boundary(torch.full((B,), S), torch.full((B,), T)).to(device)
    return lm, am, symbols, boundary


def loss_on(device: torch.device, shape: Tuple[int, int, int, int], seed: int):
    """One loss call's closure on ``device`` and its leaves (lm, am): the smoothed simple loss with its
    posteriors, the prune ranges, a tanh joiner on the windows and the pruned loss, then backward."""
    lm, am, symbols, boundary = random_lattice(device, shape, seed)

    def call():
        simple, (px_grad, py_grad) = rnnt_loss_smoothed(
            lm, am, symbols, 0, 0.1, 0.1, boundary, reduction="sum", return_grad=True
        )
        ranges = get_rnnt_prune_ranges(px_grad, py_grad, boundary, s_range=5)
        pruned_am, pruned_lm = do_rnnt_pruning(am, lm, ranges)
        logits = 4.0 * torch.tanh(pruned_am + pruned_lm)
        pruned = rnnt_loss_pruned(logits, symbols, ranges, 0, boundary, reduction="sum")
        (0.5 * simple + pruned).backward()
        return simple.detach(), pruned.detach()

    return call, (lm, am)


@contextmanager
def count_host_syncs(counts: Counter, phase: Sequence[str] = ("step",), enabled: bool = True) -> Iterator[None]:
    """Count into ``counts``, by (``phase[0]`` at the time, the icefall_lite function that caused it), the host
    synchronisations that ``torch.cuda.set_sync_debug_mode("warn")`` reports inside the block."""
    if not enabled:
        yield
        return

    def where() -> str:
        frames = [
            f for f in traceback.extract_stack()[:-2] if "icefall_lite" in f.filename or "benchmarks" in f.filename
        ]
        inner = [f for f in frames if "icefall_lite" in f.filename]
        frame = (inner or frames or [traceback.extract_stack()[-3]])[-1]
        return f"{frame.filename.split('icefall_lite/')[-1]}:{frame.name}"

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counts[(phase[0], where())] += 1

    original = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = original


def busy_seconds(intervals: Sequence[Tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (µs in, seconds out): the time some kernel ran,
    overlapping kernels (several streams) counted once."""
    total, end = 0.0, -float("inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6


def kernel_profile(fn: Callable[[], object]) -> Tuple[int, float]:
    """``(kernels, busy seconds)`` of one call of ``fn`` on the GPU: the CUDA kernels (and copies) the profiler
    saw, and the union of their intervals. Not the user annotations Kineto also puts on the GPU's timeline
    (``record_function`` spans, e.g. the optimizer's step): they are no work, and span the gaps between kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    return len(device), busy_seconds([(e.time_range.start, e.time_range.end) for e in device])
