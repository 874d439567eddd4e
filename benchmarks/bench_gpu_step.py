#!/usr/bin/env python3
"""The training step on a GPU: where its time goes.

The icefall preset's training step (train.py's ``train_step``: forward, simple and pruned loss, backward,
gradient control, optimizer step) on synthetic LibriSpeech-shaped batches (every utterance of a batch the
same length, as a bucketing sampler makes them), in float32 and under float16 and bfloat16 autocast, eager
(with the Triton recursion, and in float32 with the PyTorch one too) and replayed as a CUDA graph. Per
batch and precision: the median wall time of a step, the GPU's busy time in one profiled step (the union of
its kernels' intervals) against that median, the CUDA kernels launched and the host synchronisations in a
step, seconds of audio trained per second, and peak memory. Then the loss alone at B 28, T 350, S 80,
V 500 in float32: the pruned path as train.py runs it, its recursion by the Triton kernel (the CUDA default)
and by the PyTorch recursion, the library's full ``rnnt_loss`` on the same lattice, and torchaudio's CUDA
``rnnt_loss`` where torchaudio is installed; and the mutual-information recursion inside them alone, the
PyTorch recursion beside the Triton kernel (with their largest difference).

Without a CUDA GPU it refuses. ``--dry-run`` runs the same measurements on the CPU at tiny shapes, to check
the script itself: its figures mean nothing, and it writes no section.

Usage (from the repository root; ``make gpu-check`` runs it as its check 10):
  python -m benchmarks.bench_gpu_step --markdown-out /tmp/gpu-step.md
  python -m benchmarks.bench_gpu_step --dry-run
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from benchmarks.common import (
    Section,
    add_common_arguments,
    fmt_mb,
    fmt_ms,
    markdown_table,
    median,
    peak_memory_bytes,
    setup_threads,
    timed,
)
from benchmarks.gpu_probes import count_host_syncs, kernel_profile, loss_on, random_lattice
from benchmarks.train_setup import FRAMES_PER_SECOND, Batch, TokenTable, Trainer
from icefall_lite.nn import mutual_information
from icefall_lite.nn.mutual_information import mutual_information_recursion
from icefall_lite.nn.rnnt_loss import rnnt_loss
from icefall_lite.train.cuda_graphs import WARMUP_STEPS, StepGraphs
from icefall_lite.train.step import train_step

# (utterances, seconds each): icefall's --max-duration 200 filled three ways, then 10 s utterances at 2x,
# 4x and 8x that batch (where a large GPU's memory goes).
STEP_BATCHES: Tuple[Tuple[int, float], ...] = ((13, 15.0), (20, 10.0), (50, 4.0), (40, 10.0), (80, 10.0), (160, 10.0))
DRY_BATCHES: Tuple[Tuple[int, float], ...] = ((2, 0.4), (3, 0.3))
# The dry run's model: the icefall preset at 2 of its 12 layers (its LSTM, projection and widths), since the CPU
# checks the path here, not its time (the 12 layers' steps took most of the test suite's longest test).
DRY_MODEL_FLAGS = ("--num-encoder-layers", "2")
# (B, T, S, V) of the loss alone: about 14 s utterances after 4x subsampling, icefall's BPE-500.
LOSS_SHAPE = (28, 350, 80, 500)
DRY_LOSS_SHAPE = (2, 12, 4, 10)
VOCAB_SIZE = 500  # icefall's LibriSpeech BPE model
# BPE-500 tokens per second of LibriSpeech speech: the loss shape's S 80 tokens in about 14 s (about 2.7
# words a second at about 2.1 tokens a word).
TOKENS_PER_SECOND = 80 / 14.0


@dataclass(frozen=True)
class Arm:
    """One way to run the step: its precision's flags, the loss recursion and whether it is a CUDA graph."""

    precision: str
    flags: Tuple[str, ...]
    recursion: str = "auto"  # mutual_information.BACKEND: auto is the Triton kernel on CUDA
    graphed: bool = False

    @property
    def name(self) -> str:
        how = "graphed" if self.graphed else "eager" + (", PyTorch recursion" if self.recursion == "pytorch" else "")
        return f"{self.precision}, {how}"


ARMS = (
    Arm("float32", ()),
    Arm("float32", (), recursion="pytorch"),  # the step before the Triton kernel was wired in (issue 74)
    Arm("float32", (), graphed=True),
    Arm("float16", ("--use-fp16", "true")),
    Arm("float16", ("--use-fp16", "true"), graphed=True),
    Arm("bfloat16", ("--use-bf16", "true")),
    Arm("bfloat16", ("--use-bf16", "true"), graphed=True),
)
MAX_WARM_UP = 16  # float16 steps until the GradScaler's first finite step (it backs off from 65536)


@dataclass(frozen=True)
class StepFigures:
    """One batch and precision: median wall seconds of a step, GPU busy seconds in one step, kernels and
    host synchronisations in one step (None on the CPU), peak bytes allocated in one step."""

    wall: float
    busy: Optional[float]
    kernels: Optional[int]
    syncs: Optional[int]
    peak: int
    audio: float


def uniform_batch(utterances: int, seconds: float, tokens: TokenTable, seed: int) -> Batch:
    """``utterances`` utterances of ``seconds`` each: random 80-bin features and random BPE-500 token ids
    (``TOKENS_PER_SECOND``), registered in ``tokens``."""
    frames = int(round(seconds * FRAMES_PER_SECOND))
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(utterances, frames, 80, generator=gen) * 3.0 - 8.0
    num_tokens = max(1, round(seconds * TOKENS_PER_SECOND))
    texts = []
    for i in range(utterances):
        key = f"{utterances}x{seconds:g}s-{i}"
        tokens.ids[key] = torch.randint(3, VOCAB_SIZE, (num_tokens,), generator=gen).tolist()
        texts.append(key)
    data = {"inputs": feats, "supervisions": {"num_frames": torch.full((utterances,), frames), "text": texts}}
    return Batch(data, utterances * seconds)


def measure_step(
    trainer: Trainer, batch: Batch, tokens: TokenTable, device: torch.device, reps: int, graphed: bool = False
) -> StepFigures:
    """Warm-up steps until one is finite (the float16 scaler's back-offs) and, ``graphed``, until the batch's
    shape is captured, ``reps`` timed steps, then one profiled, one with its host synchronisations counted and
    one for peak memory (on the GPU)."""
    scaler = torch.amp.GradScaler("cuda") if trainer.args.use_fp16 else None
    graphs = StepGraphs(device, start_batch=0) if graphed else None
    training = trainer.training(tokens, scaler=scaler, graphs=graphs)
    for _ in range(WARMUP_STEPS + 1 if graphed else 0):  # the shape's eager steps and its capture
        train_step(training, batch.data)

    def step() -> None:
        train_step(training, batch.data)  # the batch on the CPU: train_step copies it, as in train.py

    for _ in range(MAX_WARM_UP):
        _, norm, _ = train_step(training, batch.data)
        if math.isfinite(norm):
            break
    else:
        raise RuntimeError(f"{MAX_WARM_UP} steps in a row had a non-finite gradient norm")
    wall = median([timed(step) for _ in range(reps)])
    if device.type != "cuda":
        return StepFigures(wall, None, None, None, peak_memory_bytes(step), batch.audio_seconds)
    kernels, busy = kernel_profile(step)
    syncs: Counter = Counter()
    with count_host_syncs(syncs):
        step()
    return StepFigures(wall, busy, kernels, sum(syncs.values()), peak_memory_bytes(step), batch.audio_seconds)


def step_table(
    device: torch.device, batches: Sequence[Tuple[int, float]], reps: int, model_flags: Sequence[str] = ()
) -> str:
    """Every batch in every precision (float16 only on CUDA: the GradScaler needs it); ``model_flags`` on top of
    the icefall preset."""
    tokens = TokenTable()
    made = [uniform_batch(n, s, tokens, seed=i) for i, (n, s) in enumerate(batches)]
    rows = []
    for arm in ARMS:
        if (arm.precision == "float16" or arm.graphed) and device.type != "cuda":
            logging.info(f"{arm.name} left out: it runs on CUDA only (the GradScaler, CUDA graphs)")
            continue
        if arm.recursion == "pytorch" and device.type != "cuda":
            logging.info(f"{arm.name} left out: on the CPU the eager arm's recursion is the PyTorch one already")
            continue
        trainer = Trainer(["--model-preset", "icefall", *model_flags, *arm.flags], vocab_size=VOCAB_SIZE, seed=0)
        trainer.model.to(device)
        for (n, s), batch in zip(batches, made):
            with recursion_by(arm.recursion):
                f = measure_step(trainer, batch, tokens, device, reps, graphed=arm.graphed)
            busy = "-" if f.busy is None else f"{f.busy * 1e3:.1f}"
            share = "-" if f.busy is None else f"{100 * f.busy / f.wall:.0f}%"
            rows.append(
                [
                    f"{n} x {s:g} s",
                    arm.name,
                    fmt_ms(f.wall),
                    busy,
                    share,
                    "-" if f.kernels is None else f.kernels,
                    "-" if f.syncs is None else f.syncs,
                    f"{f.audio / f.wall:.0f}",
                    f"{f.peak / 2**30:.2f}",
                ]
            )
            logging.info(f"{n} x {s:g} s, {arm.name}: {fmt_ms(f.wall)} ms")
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    head = ["batch", "step", f"ms per step (median of {reps})", "GPU busy ms", "busy / wall"]
    head += ["CUDA kernels", "host syncs", "audio s per s", "peak GiB"]
    return markdown_table(head, rows)


def full_loss_on(device: torch.device, shape: Tuple[int, int, int, int], seed: int) -> Callable[[], object]:
    """The library's full ``rnnt_loss`` on the joint ``am + lm`` of ``shape``, then backward."""
    lm, am, symbols, boundary = random_lattice(device, shape, seed)

    def call() -> None:
        logits = am.unsqueeze(2) + lm.unsqueeze(1)
        rnnt_loss(logits, symbols, 0, boundary, reduction="sum").backward()

    return call


def torchaudio_loss_on(device: torch.device, shape: Tuple[int, int, int, int], seed: int) -> Callable[[], object]:
    """torchaudio's ``rnnt_loss`` on the same joint, then backward; ImportError without torchaudio."""
    from torchaudio.functional import rnnt_loss as torchaudio_rnnt_loss

    lm, am, symbols, boundary = random_lattice(device, shape, seed)
    targets = symbols.to(torch.int32)
    frames, lengths = boundary[:, 3].to(torch.int32), boundary[:, 2].to(torch.int32)

    def call() -> None:
        logits = am.unsqueeze(2) + lm.unsqueeze(1)
        torchaudio_rnnt_loss(logits, targets, frames, lengths, blank=0, reduction="sum").backward()

    return call


@contextmanager
def recursion_by(backend: str) -> Iterator[None]:
    """The mutual-information recursion run by ``backend`` ("pytorch" or "triton") inside the block."""
    saved, mutual_information.BACKEND = mutual_information.BACKEND, backend
    try:
        yield
    finally:
        mutual_information.BACKEND = saved


def _by(backend: str, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` with the recursion run by ``backend``."""

    def wrapped(*args: object, **kwargs: object) -> object:
        with recursion_by(backend):
            return fn(*args, **kwargs)

    return wrapped


def loss_table(device: torch.device, shape: Tuple[int, int, int, int], reps: int) -> str:
    """The loss alone: each path timed, profiled and measured on the same lattice shape; the pruned path
    with its recursion by the Triton kernel (the CUDA default) and by the PyTorch recursion."""
    pruned = "pruned (simple loss, ranges, pruning, tanh joiner, pruned loss)"
    paths: Dict[str, Callable[[], Callable[[], object]]] = {
        f"{pruned}, Triton recursion": lambda: _by("triton", loss_on(device, shape, 0)[0]),
        f"{pruned}, PyTorch recursion": lambda: _by("pytorch", loss_on(device, shape, 0)[0]),
        "full `rnnt_loss` (the library, its default recursion)": lambda: full_loss_on(device, shape, 0),
        "torchaudio's `rnnt_loss`": lambda: torchaudio_loss_on(device, shape, 0),
    }
    rows = []
    for name, make in paths.items():
        if "Triton" in name and mutual_information._triton_kernel() is None:
            rows.append([name, "not run: triton is not installed", "-", "-"])
            continue
        try:
            call = make()
        except (ImportError, OSError) as e:  # OSError: a torchaudio built for another torch
            logging.info(f"{name}: left out, torchaudio does not load: {e}")
            rows.append([name, f"not run: torchaudio does not load ({type(e).__name__})", "-", "-"])
            continue
        call()
        wall = median([timed(call) for _ in range(reps)])
        kernels = kernel_profile(call)[0] if device.type == "cuda" else "-"
        rows.append([name, fmt_ms(wall), kernels, fmt_mb(peak_memory_bytes(call))])
    head = ["loss path (forward + backward)", f"ms (median of {reps})", "CUDA kernels", "peak MiB"]
    return markdown_table(head, rows)


def recursion_table(device: torch.device, shape: Tuple[int, int, int, int], reps: int) -> str:
    """The mutual-information recursion alone on a regular lattice of ``shape``'s B, T, S (the score and the
    arc posteriors, as the losses call it): the PyTorch recursion and the Triton kernel, timed, profiled,
    measured, and the kernel's largest relative difference from the PyTorch results."""
    B, T, S, _ = shape
    gen = torch.Generator().manual_seed(0)
    px = torch.randn(B, S, T + 1, generator=gen).to(device)
    px[:, :, T] = float("-inf")
    py = torch.randn(B, S + 1, T, generator=gen).to(device)
    paths: Dict[str, Callable] = {"PyTorch (the CPU path)": _by("pytorch", mutual_information_recursion)}
    missing = []
    if mutual_information._triton_kernel() is None:
        missing.append(["Triton kernel", "not run: triton is not installed", "-", "-", "-"])
    else:
        paths["Triton kernel"] = _by("triton", mutual_information_recursion)
    rows = []
    with recursion_by("pytorch"):
        want = mutual_information_recursion(px, py, return_grad=True)
    for name, fn in paths.items():
        call = lambda fn=fn: fn(px, py, return_grad=True)  # noqa: E731
        try:  # the kernel's first call compiles it (Triton needs a C compiler on the host for its launcher)
            got = call()
        except Exception as e:  # reported in its row; the other measurements go on
            logging.exception(f"{name} failed")
            rows.append([name, f"failed: {type(e).__name__}: {str(e)[:200]}", "-", "-", "-"])
            continue
        wall = median([timed(call) for _ in range(reps)])
        kernels = kernel_profile(call)[0] if device.type == "cuda" else "-"
        diff = max(
            float(((g - w).abs() / w.abs().clamp(min=1e-30)).max())
            for g, w in ((got[0], want[0]), (got[1][0], want[1][0]), (got[1][1], want[1][1]))
            if w.numel()
        )
        rows.append([name, fmt_ms(wall), kernels, fmt_mb(peak_memory_bytes(call)), f"{diff:.1e}"])
    head = ["recursion (score + posteriors)", f"ms (median of {reps})", "CUDA kernels", "peak MiB"]
    return markdown_table(head + ["largest relative difference from PyTorch's"], rows + missing)


def report(device: torch.device, reps: int, dry_run: bool = False) -> str:
    """Both tables with their notes (Markdown)."""
    batches, shape = (DRY_BATCHES, DRY_LOSS_SHAPE) if dry_run else (STEP_BATCHES, LOSS_SHAPE)
    model_flags = DRY_MODEL_FLAGS if dry_run else ()
    return "\n\n".join(
        [
            step_table(device, batches, reps, model_flags),
            f"The icefall preset (`--model-preset icefall{' ' + ' '.join(model_flags) if model_flags else ''}`: "
            f"{DRY_MODEL_FLAGS[1] + ' (dry run)' if dry_run else 12} LSTM layers, hidden 1024, projection 512, "
            f"BPE-{VOCAB_SIZE}) past warm-up, `train_step` as train.py runs it, every gradient control at its "
            "default: *eager* with the loss recursion by the Triton kernel (CUDA's default), *eager, PyTorch "
            "recursion* as before the kernel was wired in, *graphed* replayed as a CUDA graph per batch shape "
            "(`--cuda-graphs`, the batch padded to its static shape); "
            f"random features, {TOKENS_PER_SECOND:.1f} random tokens a second. *GPU busy*: the union of "
            "the CUDA kernels' intervals in one profiled step, against the median step's wall time. *host syncs*: "
            'those `torch.cuda.set_sync_debug_mode("warn")` reports in one step.',
            f"The loss alone, B x T x S x V = {' x '.join(map(str, shape))}, float32:",
            loss_table(device, shape, reps),
            "The recursion inside it alone, on a regular B x (S+1) x (T+1) lattice of the same B, T, S, float32 in:",
            recursion_table(device, shape, reps),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--reps", type=int, default=5, help="Timed repetitions per measurement. (default: 5)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="Run every measurement on the CPU at tiny shapes to check this script; writes no section.",
    )
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    setup_threads(args.threads)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel on the CPU; set before it is defined
        if args.markdown_out is not None:
            sys.exit("bench_gpu_step: --dry-run measures nothing worth keeping; drop --markdown-out")
        print(report(torch.device("cpu"), args.reps, dry_run=True))
        return
    if not torch.cuda.is_available():
        sys.exit(
            f"bench_gpu_step: no CUDA GPU (torch.cuda.is_available() is False; torch {torch.__version__}, CUDA "
            f"build {torch.version.cuda}): this benchmark measures the GPU; --dry-run checks it on the CPU"
        )
    section = Section("The training step on a GPU: time, busy share, launches, syncs", args.threads)
    section.tables.append(report(torch.device("cuda", 0), args.reps))
    section.emit(args.markdown_out)


if __name__ == "__main__":
    main()
