"""The GPU step benchmark (benchmarks/bench_gpu_step.py): it refuses without a GPU, its batches have the
shapes it names, its busy time is the union of the kernels' intervals, and its dry run measures every batch
and loss path on the CPU (what can be checked without a GPU; on one it runs as ``make gpu-check``'s check 10)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_gpu_step
from benchmarks.gpu_probes import busy_seconds
from benchmarks.train_setup import TokenTable
from conftest import REPO


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on a machine with one too
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu_step", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # a hang's guard: 107-121 s seen on 2 cores beside other jobs
        env=env,
    )


def test_it_refuses_without_a_gpu_and_a_dry_run_writes_nothing(tmp_path) -> None:
    out = tmp_path / "section.md"
    proc = _run("--markdown-out", str(out))
    assert proc.returncode == 1 and "bench_gpu_step: no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    proc = _run("--dry-run", "--markdown-out", str(out))
    assert proc.returncode == 1 and "drop --markdown-out" in proc.stderr
    assert not out.exists()


def test_busy_time_counts_overlapping_kernels_once() -> None:
    # µs: [0, 10] and [5, 15] overlap (15 µs together), [20, 30] alone (10), [22, 25] inside it.
    assert busy_seconds([(20, 30), (0, 10), (5, 15), (22, 25)]) == pytest.approx(25e-6)
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 4), (4, 6)]) == pytest.approx(6e-6)


def test_uniform_batches_have_the_shape_they_name() -> None:
    tokens = TokenTable()
    batch = bench_gpu_step.uniform_batch(13, 15.0, tokens, seed=0)
    assert batch.data["inputs"].shape == (13, 1500, 80) and batch.audio_seconds == 195.0
    assert batch.data["supervisions"]["num_frames"].tolist() == [1500] * 13
    ids = tokens.encode(batch.data["supervisions"]["text"])
    # 15 s at 80 tokens per 14 s: round(85.7) = 86 tokens each, none blank (0) or below 3, all under 500.
    assert [len(x) for x in ids] == [86] * 13
    assert min(min(x) for x in ids) >= 3 and max(max(x) for x in ids) < 500
    again = bench_gpu_step.uniform_batch(13, 15.0, TokenTable(), seed=0)
    assert torch.equal(again.data["inputs"], batch.data["inputs"])


def test_the_dry_run_measures_every_batch_and_loss_path_on_the_cpu() -> None:
    proc = _run("--dry-run", "--reps", "1")  # no GPU visible: the Triton kernel runs in Triton's interpreter
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    steps = [r for r in rows if re.match(r"\| \d+ x", r[0])]
    # Every dry batch in float32 and bfloat16, eager; float16 (CUDA's GradScaler), the graphed arms (CUDA graphs)
    # and the PyTorch recursion's (the CPU's eager recursion already) are left out on the CPU.
    arms = ("float32, eager", "bfloat16, eager")
    assert [(r[0], r[1]) for r in steps] == [
        (f"| {n} x {s:g} s", a) for a in arms for n, s in bench_gpu_step.DRY_BATCHES
    ]
    for r in steps:
        ms, audio_per_s = float(r[2]), float(r[7])
        assert ms > 0 and r[3:7] == ["-", "-", "-", "-"]  # the GPU's figures only on a GPU
        n, s = re.match(r"\| (\d+) x ([\d.]+) s", r[0]).groups()
        assert audio_per_s == pytest.approx(int(n) * float(s) / (ms / 1e3), abs=0.5)
    losses = {r[0].strip("| "): r[1] for r in rows if "loss" in r[0] or "pruned" in r[0]}
    pruned = "pruned (simple loss, ranges, pruning, tanh joiner, pruned loss)"
    assert float(losses[f"{pruned}, Triton recursion"]) > 0  # the kernel, in Triton's interpreter
    assert float(losses[f"{pruned}, PyTorch recursion"]) > 0
    assert float(losses["full `rnnt_loss` (the library, its default recursion)"]) > 0
    assert "torchaudio's `rnnt_loss`" in losses
    assert "B x T x S x V = 2 x 12 x 4 x 10" in text
    assert "(`--model-preset icefall --num-encoder-layers 2`: 2 (dry run) LSTM layers" in text
    recursion = {r[0].strip("| "): r for r in rows if r[0] in ("| PyTorch (the CPU path)", "| Triton kernel")}
    assert float(recursion["PyTorch (the CPU path)"][4].strip(" |")) == 0.0  # against itself
    assert float(recursion["Triton kernel"][4].strip(" |")) < 1e-6  # the kernel, in Triton's interpreter
