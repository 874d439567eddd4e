#!/usr/bin/env python3
"""Benchmark 1: pruned vs full transducer loss, forward + backward.

Pruned path (what ``Transducer.forward`` does after the encoder and decoder):
simple projections + smoothed simple loss with occupancy posteriors ->
``get_rnnt_prune_ranges`` (s_range 5) -> ``do_rnnt_pruning`` -> joiner on the
windows -> ``rnnt_loss_pruned``; backward of ``0.5 * simple + pruned``.

Full path: joiner on the whole ``(B, T, U+1)`` lattice -> ``rnnt_loss``;
backward.

Both start from the same encoder/decoder outputs (leaf tensors that require
grad, standing in for the encoder and decoder) and the same joiner weights.
Repetitions of the two paths are interleaved; the table gives medians and the
ratio. Peak memory is measured in a separate call of each path (the
allocation accounting slows it down).

Usage:
  python -m benchmarks.bench_loss                 # B=8, T=200, U=40, V=500, joiner dim 512
  python -m benchmarks.bench_loss --reps 3 --batch-size 2   # a quick look
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn as nn

from benchmarks.common import (
    Section,
    add_common_arguments,
    fmt_mb,
    fmt_ms,
    interleaved_times,
    markdown_table,
    median,
    memory_method,
    paired_ratio,
    peak_memory_bytes,
    setup_threads,
)
from icefall_lite.nn.joiner import Joiner
from icefall_lite.nn.rnnt_loss import (
    do_rnnt_pruning,
    get_rnnt_prune_ranges,
    make_boundary,
    rnnt_loss,
    rnnt_loss_pruned,
    rnnt_loss_smoothed,
)
from icefall_lite.nn.scaling import ScaledLinear
from icefall_lite.utils import script_parser

BLANK = 0


@dataclass
class LossProblem:
    """Inputs and weights of one loss evaluation, shared by both paths."""

    encoder_out: torch.Tensor  # (B, T, dim), requires grad
    decoder_out: torch.Tensor  # (B, U+1, dim), requires grad
    targets: torch.Tensor  # (B, U) int64, no blank
    frame_lens: torch.Tensor  # (B,)
    target_lens: torch.Tensor  # (B,)
    joiner: Joiner
    simple_am_proj: nn.Module
    simple_lm_proj: nn.Module
    prune_range: int

    def zero_grad(self) -> None:
        for tensor in self.leaves():
            tensor.grad = None

    def leaves(self) -> Sequence[torch.Tensor]:
        modules = (self.joiner, self.simple_am_proj, self.simple_lm_proj)
        return [self.encoder_out, self.decoder_out] + [p for m in modules for p in m.parameters()]


def make_problem(
    batch_size: int,
    frames: int,
    symbols: int,
    vocab_size: int,
    dim: int,
    prune_range: int,
    device: torch.device,
    seed: int = 0,
) -> LossProblem:
    """Random encoder/decoder outputs and weights; every sequence has the full T frames and U symbols."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    encoder_out = torch.randn(batch_size, frames, dim, generator=gen).to(device).requires_grad_()
    decoder_out = torch.randn(batch_size, symbols + 1, dim, generator=gen).to(device).requires_grad_()
    targets = torch.randint(1, vocab_size, (batch_size, symbols), generator=gen).to(device)
    return LossProblem(
        encoder_out=encoder_out,
        decoder_out=decoder_out,
        targets=targets,
        frame_lens=torch.full((batch_size,), frames, dtype=torch.int64, device=device),
        target_lens=torch.full((batch_size,), symbols, dtype=torch.int64, device=device),
        joiner=Joiner(dim, dim, dim, vocab_size, blank_id=0).to(device),
        simple_am_proj=ScaledLinear(dim, vocab_size, initial_speed=0.5).to(device),
        simple_lm_proj=ScaledLinear(dim, vocab_size).to(device),
        prune_range=prune_range,
    )


def pruned_loss(p: LossProblem) -> torch.Tensor:
    """Simple loss + pruning + joiner on the windows + pruned loss: ``0.5 * simple + pruned`` (forward only)."""
    boundary = make_boundary(p.target_lens, p.frame_lens)
    lm = p.simple_lm_proj(p.decoder_out)
    am = p.simple_am_proj(p.encoder_out)
    simple_loss, (px_grad, py_grad) = rnnt_loss_smoothed(
        lm=lm,
        am=am,
        symbols=p.targets,
        termination_symbol=BLANK,
        lm_only_scale=0.25,
        am_only_scale=0.0,
        boundary=boundary,
        reduction="sum",
        return_grad=True,
    )
    ranges = get_rnnt_prune_ranges(px_grad=px_grad, py_grad=py_grad, boundary=boundary, s_range=p.prune_range)
    am_pruned, lm_pruned = do_rnnt_pruning(
        am=p.joiner.encoder_proj(p.encoder_out), lm=p.joiner.decoder_proj(p.decoder_out), ranges=ranges
    )
    logits = p.joiner(am_pruned, lm_pruned, project_input=False)
    pruned = rnnt_loss_pruned(
        logits=logits, symbols=p.targets, ranges=ranges, termination_symbol=BLANK, boundary=boundary, reduction="sum"
    )
    return 0.5 * simple_loss + pruned


def full_loss(p: LossProblem) -> torch.Tensor:
    """Joiner on the full (B, T, U+1) lattice + full RNN-T loss (forward only)."""
    enc = p.joiner.encoder_proj(p.encoder_out).unsqueeze(2)  # (B, T, 1, J)
    dec = p.joiner.decoder_proj(p.decoder_out).unsqueeze(1)  # (B, 1, U+1, J)
    logits = p.joiner(enc, dec, project_input=False)  # (B, T, U+1, V)
    boundary = make_boundary(p.target_lens, p.frame_lens)
    return rnnt_loss(logits=logits, symbols=p.targets, termination_symbol=BLANK, boundary=boundary, reduction="sum")


def step(p: LossProblem, loss_fn: Callable[[LossProblem], torch.Tensor]) -> float:
    """Forward and backward of one path. As in training, backward runs after the
    forward function returned, so only what autograd saved is alive during it."""
    p.zero_grad()
    loss = loss_fn(p)
    loss.backward()
    return float(loss.detach())


PATHS: Dict[str, Callable[[LossProblem], torch.Tensor]] = {"pruned": pruned_loss, "full": full_loss}


@dataclass
class Comparison:
    """Median times, paired time ratio and peak memory of both paths for one problem size."""

    times: Dict[str, float]
    time_ratio: float
    memory: Dict[str, int]

    @property
    def memory_ratio(self) -> float:
        return self.memory["full"] / max(self.memory["pruned"], 1)


def compare(problem: LossProblem, reps: int, measure_memory: bool = True) -> Comparison:
    """Interleaved timing of both paths, then one memory-accounted call of each."""
    times = interleaved_times({name: (lambda f=f: step(problem, f)) for name, f in PATHS.items()}, reps=reps)
    memory = (
        {name: peak_memory_bytes(lambda f=f: step(problem, f)) for name, f in PATHS.items()} if measure_memory else {}
    )
    return Comparison(
        times={name: median(t) for name, t in times.items()},
        time_ratio=paired_ratio(times["full"], times["pruned"]),
        memory=memory,
    )


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=8, help="B. (default: 8)")
    parser.add_argument("--frames", type=int, default=200, help="T, encoder frames. (default: 200)")
    parser.add_argument("--symbols", type=int, default=40, help="U, target symbols. (default: 40)")
    parser.add_argument("--vocab-size", type=int, default=500, help="V. (default: 500)")
    parser.add_argument(
        "--joiner-dim", type=int, default=512, help="Joiner dim (also the encoder/decoder output dim). (default: 512)"
    )
    parser.add_argument("--prune-range", type=int, default=5, help="s_range of the pruned loss. (default: 5)")
    parser.add_argument("--reps", type=int, default=7, help="Timed repetitions of each path. (default: 7)")
    add_common_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    setup_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = make_problem(
        args.batch_size, args.frames, args.symbols, args.vocab_size, args.joiner_dim, args.prune_range, device
    )
    result = compare(problem, args.reps)
    speed_ok = result.time_ratio >= 5.0
    memory_ok = result.memory_ratio >= 8.0
    rows = [[name, fmt_ms(result.times[name]), fmt_mb(result.memory[name])] for name in ("pruned", "full")]
    rows.append(["full / pruned", f"{result.time_ratio:.2f}x", f"{result.memory_ratio:.2f}x"])
    table = markdown_table(["path", "median time fwd+bwd (ms)", "peak memory (MiB)"], rows)
    section = Section(
        title="1. Pruned vs full transducer loss (forward + backward)",
        threads=args.threads,
        tables=[table],
        notes=[
            f"B={args.batch_size}, T={args.frames}, U={args.symbols}, V={args.vocab_size}, joiner dim "
            f"{args.joiner_dim}, s_range {args.prune_range}, all sequences full length, float32, device {device}.",
            "pruned = simple projections + smoothed simple loss (lm_only_scale 0.25) with posteriors + "
            "get_rnnt_prune_ranges + do_rnnt_pruning + joiner on the windows + rnnt_loss_pruned, backward of "
            "0.5 * simple + pruned; full = joiner on the whole lattice + rnnt_loss, backward.",
            f"{args.reps} interleaved repetitions after one warm-up; the ratio is the median of the per-repetition "
            "ratios.",
            f"Peak memory: {memory_method()}.",
            f"Goal pruned >= 5x faster: {'met' if speed_ok else 'missed'} ({result.time_ratio:.2f}x); "
            f">= 8x less peak memory: {'met' if memory_ok else 'missed'} ({result.memory_ratio:.2f}x).",
            "Where the memory goes (profiled on CPU): each path peaks holding three lattice-sized tensors "
            "(full: in the joiner's backward, the tanh output, its gradient and the pre-tanh gradient; "
            "pruned: in the forward, the gathered decoder frames, the tanh output and the logits), of (U+1) = "
            f"{args.symbols + 1} cells per frame on the full path and s_range = {args.prune_range} on the "
            f"pruned one, so the ratio can reach at most (U+1)/s_range = "
            f"{(args.symbols + 1) / args.prune_range:.1f}x, and less by what only the pruned path holds (the "
            "simple loss's (B, T, V) and (B, U+1, T) tensors, the projections). Benchmark 2 shows the ratio "
            "growing with U.",
        ],
    )
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
