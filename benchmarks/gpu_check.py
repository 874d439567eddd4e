#!/usr/bin/env python3
"""The GPU check: the CUDA path of training, decoding and the loss, on one GPU, in one command.

Run from a clone with ``make gpu-check`` (the tiny corpus is prepared first), or
``python -m benchmarks.gpu_check --work-dir DIR`` on a corpus prepared by
``prepare.sh --size tiny --work-dir DIR``. Each check runs even when an
earlier one failed; the report (``--report``, Markdown) is written as the
checks finish, and the command exits 1 when any check failed. Without a CUDA
GPU it fails at once: nothing here can be checked on a CPU.

The checks (those in one process first, then the recipe's scripts):

1. The dtype every LSTM's output has under autocast (forward hooks): float16
   with ``--use-fp16``, bfloat16 with ``--use-bf16``.
2. A non-finite gradient injected under the GradScaler: the update skipped,
   the scale halved, the weights unchanged, a back-off counted (not a skipped
   step), and the next step trains.
3. The simple and the pruned loss, values and gradients, CUDA against the
   CPU at two lattice shapes, with time per call, kernel launches and peak
   memory.
4. One training step under ``torch.cuda.set_sync_debug_mode("warn")``: the
   host synchronisations counted by the function that caused them.
5. Training time per step of the icefall-preset model in float32, float16
   and bfloat16 on one fixed batch.
6. train.py with ``--preset icefall`` (12 layers, LSTM hidden 1024 with
   projection: the cuDNN path with ``proj_size``) for 16 batches in float32,
   ``--use-fp16`` (stopped at 8 and resumed), ``--use-bf16`` and float32 with ``--cuda-graphs true``
   (stopped at 8 and resumed: graphs made again): finite
   weights, the model average updated, the resume taken from checkpoint-8.pt.
7. decode.py with the three decoding methods and streaming_decode.py on
   CUDA, from the float32 run's averaged model.
8. Two DDP ranks (gloo, on the one GPU): a step where one rank's batch has
   no finite loss leaves identical weights on both, and --max-minutes stops
   both at the same batch.
9. Every gradient control of ``icefall_lite.train.rules.RULES`` (the filter
   in each of its modes, the recurrent cap, the error clip, value, AGC, the
   norm clip, the relative clip, ZClip, AutoClip, ScaledAdam's rule) on alone for 30 steps of a small model on
   the CPU, each step run again on CUDA from the CPU run's state before it:
   the steps where it acted, the losses, clip scales and the gradients the
   optimizer received, and its CUDA step time and host synchronisations.
10. The training step's profile (``bench_gpu_step``): eager, eager with the PyTorch recursion and graphed.
11. The icefall preset's step as a CUDA graph against the eager step (float32, TF32 off): 8 steps of one
    batch shape, 1 eager, a capture, 6 replays, one of them a NaN batch skipped; losses, gradient norms and
    weights within 1e-5 relative. (Check 6 also trains with ``--cuda-graphs true``, stopped and resumed.)

They run in the order of ``ORDER`` (what no GPU has run yet first) within ``--minutes`` (default 7.5,
counted from the script's start, the corpus's preparation included): a check still running at the end is
stopped and reported as such, the checks not reached are listed with the ``--only`` command that runs them,
and the command exits 1 unless every check asked for ran and passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from benchmarks import bench_gpu_step
from benchmarks.common import markdown_table
from benchmarks.gpu_probes import count_host_syncs, loss_on
from benchmarks.train_setup import Batch, TokenTable, Trainer, add_batch_arguments, make_batches
from icefall_lite.nn.clip import GRAD_FILTER_MODES
from icefall_lite.nn.scaling import ScaledLSTM
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.train.cuda_graphs import WARMUP_STEPS, StepGraphs
from icefall_lite.train.loop import budget_spent, filter_stats, log_step
from icefall_lite.train.optimizer_state import SecondMomentMonitor
from icefall_lite.train.rules import RULES
from icefall_lite.train.setup import model_checksum
from icefall_lite.train.step import train_step
from icefall_lite.train.step_log import read_metrics, read_scalars

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "egs" / "librispeech" / "ASR"
SCRIPTS = RECIPE / "lstm_transducer_stateless"
BPE = "data/lang_bpe_100/bpe.model"
# Batches of about two utterances keep the 16 batches inside epoch 1 of the tiny corpus, so the 84.7
# M-parameter model's checkpoints (model, float64 average, optimizer: about 1.7 GB each) are only
# checkpoint-8.pt and checkpoint-16.pt.
TRAIN_FLAGS = ["--preset", "icefall", "--bpe-model", BPE, "--max-duration", "6", "--save-every-n", "8"]
TRAIN_FLAGS += ["--average-period", "2", "--log-interval", "4", "--tensorboard", "false"]
DECODE_FLAGS = ["--model-preset", "icefall", "--bpe-model", BPE, "--iter", "16", "--avg", "1"]
DECODE_FLAGS += ["--use-averaged-model", "true", "--max-duration", "60"]
# Check 6's graphed run: graphs from batch 2 (the end of a 1-batch model warm-up), an error if one cannot be made.
GRAPH_TRAIN_FLAGS = ["--cuda-graphs", "true", "--model-warm-step", "1"]
# Check 11: steps of one batch shape, eager and graphed; the batch of GRAPH_NAN_STEP has NaN features.
GRAPH_STEPS = 8
GRAPH_NAN_STEP = 6
# Lattice shapes of check 5: (batch, frames T, symbols S, vocabulary V).
LOSS_SHAPES = [(8, 25, 110, 500), (8, 250, 15, 50)]


# The order the checks run in: those no GPU has run yet first (the graphed step, the step's profile, the
# training runs with their graphed run), then the rest; 7 decodes 6's float32 model.
ORDER = (11, 10, 6, 7, 4, 3, 9, 8, 1, 2, 5)
# The device script's budget: a lent GPU's session is asked for at most 8 minutes; 30 s are left for the
# interpreter's start, the imports and the machine's file transfers.
DEFAULT_MINUTES = 7.5


class OutOfTime(Exception):
    """Raised in the check running when the budget ends (SIGALRM)."""


class Report:
    """The Markdown report, rewritten after every check so that a run cut short keeps what it found."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parts: List[str] = []
        self.failures: List[str] = []
        self.stopped: List[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text.rstrip() + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(self.parts))
        tmp.replace(self.path)
        print(text, flush=True)

    def run(self, title: str, check: Callable[[], str], seconds: float) -> bool:
        """Run one check for at most ``seconds`` and report it; False when the budget ended during it."""
        start = time.time()
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            try:
                body = check()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            status = "passed"
        except OutOfTime:
            body = "```\n" + traceback.format_exc()[-2000:] + "```"
            status = "STOPPED at the time budget"
            self.stopped.append(title)
        except Exception:  # a failed check is reported and the next one runs
            body = "```\n" + traceback.format_exc()[-4000:] + "```"
            status = "FAILED"
            self.failures.append(title)
        self.add(f"## {title}: {status} ({time.time() - start:.0f} s)\n\n{body}\n")
        return not self.stopped


def run_checks(report: Report, checks: Dict[int, Tuple[str, Callable[[], str]]], deadline: float) -> str:
    """Run ``checks`` ({number: (title, check)}) in the order of ORDER until ``deadline`` (time.time()): a check
    running then is interrupted (SIGALRM, which also ends a subprocess.run it waits on: the child is killed),
    later ones are not started. Returns the verdict line (also added to the report)."""

    def out_of_time(signum, frame) -> None:
        raise OutOfTime(f"the budget ended at {time.strftime('%H:%M:%S')}")

    previous = signal.signal(signal.SIGALRM, out_of_time)
    passed, not_run = [], []
    try:
        for number in sorted(checks, key=ORDER.index):
            title, check = checks[number]
            left = deadline - time.time()
            if left <= 0 or report.stopped:
                not_run.append(number)
                continue
            if report.run(title, check, left) and title not in report.failures:
                passed.append(number)
    finally:
        signal.signal(signal.SIGALRM, previous)
    for child in multiprocessing.active_children():  # a stopped check's workers (check 8's ranks)
        child.terminate()
    parts = [f"passed: {', '.join(map(str, passed)) or 'none'}"]
    if report.failures:
        parts.append(f"FAILED: {', '.join(report.failures)}")
    if report.stopped:
        parts.append(f"STOPPED at the time budget: {', '.join(report.stopped)}")
    if not_run:
        numbers = ",".join(map(str, not_run))
        parts.append(f"not run (out of time): {numbers.replace(',', ', ')}; run them with `--only {numbers}`")
    verdict = "all checks passed" if len(passed) == len(checks) else "; ".join(parts)
    report.add(f"**{verdict}**")
    return verdict


def run_script(script: str, args: Sequence[str], work_dir: Path, log: Path) -> Tuple[float, str]:
    """Run a recipe script in ``work_dir``; its output goes to ``log``; an error names the script and the log's
    tail. Returns (wall seconds, output)."""
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args], cwd=work_dir, capture_output=True, text=True, timeout=900
    )
    seconds = time.time() - start
    output = proc.stdout + proc.stderr
    log.write_text(output)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} exited {proc.returncode}:\n{output[-3000:]}")
    return seconds, output


def check_checkpoint(path: Path, batches: int) -> str:
    """The checkpoint at ``path`` is of batch ``batches``, finite, and its model average differs from the model."""
    ckpt = load_checkpoint_file(path)
    assert ckpt["batch_idx_train"] == batches, (path, ckpt["batch_idx_train"])
    model, avg = ckpt["model"], ckpt["model_avg"]
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point()), f"{path}: non-finite weights"
    assert all(torch.isfinite(v).all() for v in avg.values() if v.is_floating_point()), f"{path}: non-finite average"
    differs = sum(not torch.equal(model[k].double(), avg[k].double()) for k in model if model[k].is_floating_point())
    assert differs > 0, f"{path}: the model average equals the model"
    return f"{path.name}: batch {batches}, weights finite, model average finite and updated ({differs} tensors differ)"


def training_runs(work_dir: Path, out: Path) -> str:
    rows = []
    notes = []
    for precision, flags in (
        ("float32", []),
        ("float16", ["--use-fp16", "true"]),
        ("bfloat16", ["--use-bf16", "true"]),
        ("float32-graphs", GRAPH_TRAIN_FLAGS),
    ):
        exp = work_dir / f"exp-{precision}"
        common = [*TRAIN_FLAGS, "--exp-dir", str(exp), *flags]
        if precision in ("float16", "float32-graphs"):
            log = f"train-{precision}"
            first, before = run_script("train.py", [*common, "--max-batches", "8"], work_dir, out / f"{log}-a.log")
            seconds, output = run_script("train.py", [*common, "--max-batches", "16"], work_dir, out / f"{log}.log")
            assert re.search(r"Loading checkpoint \S*checkpoint-8\.pt", output), "the second run did not resume"
            notes.append(f"{precision}: stopped at batch 8 and resumed from checkpoint-8.pt to 16")
            seconds += first
            if precision == "float32-graphs":
                captured = [len(re.findall("Captured the training step", o)) for o in (before, output)]
                assert sum(captured) > 0, "no graph was captured"  # (a failed capture is an error under true)
                notes.append(
                    f"{precision}: graphs captured before the stop {captured[0]}, after the resume {captured[1]}"
                )
        else:
            seconds, output = run_script(
                "train.py", [*common, "--max-batches", "16"], work_dir, out / f"train-{precision}.log"
            )
        assert "Device: cuda" in output, "train.py did not train on CUDA"
        loss = re.findall(r"tot_loss\[loss=([0-9.na]+)", output)
        notes.append(check_checkpoint(exp / "checkpoint-16.pt", 16))
        backoffs = re.findall(r"loss-scale back-offs: (\d+)", output)
        rows.append([precision, f"{seconds:.1f}", loss[-1] if loss else "-", backoffs[-1] if backoffs else "-"])
    table = markdown_table(["precision", "wall s (all processes)", "last tot_loss", "loss-scale back-offs"], rows)
    return table + "\n\n" + "\n".join(f"- {n}" for n in notes)


def decoding_runs(work_dir: Path, out: Path) -> str:
    exp = work_dir / "exp-float32"
    rows = []
    for script, method in (
        ("decode.py", "greedy_search"),
        ("decode.py", "modified_beam_search"),
        ("decode.py", "fast_beam_search"),
        ("streaming_decode.py", "greedy_search"),
    ):
        args = [*DECODE_FLAGS, "--exp-dir", str(exp), "--decoding-method", method]
        seconds, output = run_script(script, args, work_dir, out / f"{script[:-3]}-{method}.log")
        res_dir = exp / ("streaming" if script.startswith("streaming") else "") / method
        summaries = sorted(res_dir.glob("wer-summary-test-*.txt"))
        assert summaries, f"{script} {method}: no wer-summary file in {res_dir}"
        assert "Device: cuda" in output, f"{script} {method}: did not decode on CUDA"
        # wer-summary-<test>-<part>-<suffix>.txt holds "settings\tWER" and "<method>\t<WER>"
        wers = ["-".join(p.name.split("-")[2:4]) + " " + p.read_text().split()[-1] for p in summaries]
        rows.append([script, method, f"{seconds:.1f}", ", ".join(wers)])
    note = "WERs of 16 batches of training are not a result; the check is that each search runs on CUDA."
    return markdown_table(["script", "method", "wall s", "WER"], rows) + "\n\n" + note


def icefall_trainer(flags: Sequence[str], device: torch.device) -> Trainer:
    trainer = Trainer(["--model-preset", "icefall", *flags], vocab_size=500, seed=0)
    trainer.model.to(device)
    return trainer


def batches(num: int = 2) -> Tuple[TokenTable, list]:
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    args = parser.parse_args(["--max-duration", "60", "--vocab-size", "500", "--num-batches", str(num)])
    tokens = TokenTable()
    return tokens, make_batches(args, tokens)


def lstm_dtypes(device: torch.device) -> str:
    tokens, data = batches(1)
    rows = []
    for name, flags, expected in (
        ("--use-fp16", ["--use-fp16", "true"], torch.float16),
        ("--use-bf16", ["--use-bf16", "true"], torch.bfloat16),
    ):
        trainer = icefall_trainer(flags, device)
        seen: List[torch.dtype] = []
        hooks = [
            m.register_forward_hook(lambda _m, _i, out: seen.append(out[0].dtype))
            for m in trainer.model.modules()
            if isinstance(m, ScaledLSTM)
        ]
        scaler = torch.amp.GradScaler("cuda") if expected == torch.float16 else None
        train_step(trainer.training(tokens, scaler=scaler), data[0].data)
        for h in hooks:
            h.remove()
        assert len(seen) == 12, f"{name}: {len(seen)} LSTM calls, expected 12"
        assert all(d == expected for d in seen), f"{name}: LSTM outputs {sorted(set(map(str, seen)))}, want {expected}"
        rows.append([name, str(expected), len(seen), ", ".join(sorted(set(map(str, seen))))])
    return markdown_table(["flag", "expected", "LSTM calls", "output dtypes seen"], rows)


def injected_overflow(device: torch.device) -> str:
    tokens, data = batches(2)
    trainer = icefall_trainer(["--use-fp16", "true"], device)
    scaler = torch.amp.GradScaler("cuda")
    t = trainer.training(tokens, scaler=scaler)
    # Normal steps until one updates (the scaler backs off from its initial 65536 as in any fp16 run).
    for warm_up in range(1, 17):
        trainer.params.batch_idx_train += 1
        _, norm, _ = train_step(t, data[0].data)
        if math.isfinite(norm):
            break
    assert math.isfinite(norm), "16 steps in a row overflowed"
    t.flush_log()  # the back-offs, decided on the device, are counted at the log interval
    backoffs = trainer.params.scaler_backoffs
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    scale_before = scaler.get_scale()
    victim = trainer.model.joiner.output_linear.weight
    handle = victim.register_hook(lambda g: torch.full_like(g, float("inf")))
    trainer.params.batch_idx_train += 1
    _, grad_norm, _ = train_step(t, data[1].data)
    handle.remove()
    assert not math.isfinite(grad_norm), grad_norm
    unchanged = all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert unchanged, "weights changed on an overflow step"
    assert scaler.get_scale() == scale_before / 2, (scaler.get_scale(), scale_before)
    t.flush_log()
    assert trainer.params.scaler_backoffs == backoffs + 1 and trainer.params.skipped_steps == 0
    trainer.params.batch_idx_train += 1
    train_step(t, data[1].data)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters()), "no update after"
    return (
        f"The first finite step was step {warm_up} ({backoffs} back-offs from the initial scale 65536). Then inf "
        f"injected into `joiner.output_linear.weight`'s gradient: update skipped, weights unchanged, scale "
        f"{scale_before:g} -> {scale_before / 2:g}, back-offs counted {backoffs} -> {backoffs + 1}, skipped "
        "steps 0; the next step trained."
    )


def loss_parity(device: torch.device) -> str:
    rows = []
    for shape in LOSS_SHAPES:
        cpu_call, cpu_leaves = loss_on(torch.device("cpu"), shape, 0)
        gpu_call, gpu_leaves = loss_on(device, shape, 0)
        cpu_values, gpu_values = cpu_call(), gpu_call()
        for c, g in zip(cpu_values, gpu_values):
            torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-4)
        grad_err = max(
            float((g.grad.cpu() - c.grad).abs().max() / c.grad.abs().max().clamp(min=1e-30))
            for c, g in zip(cpu_leaves, gpu_leaves)
        )
        assert grad_err < 1e-4, f"{shape}: gradients differ by {grad_err:.2e} of their largest value"
        for leaf in gpu_leaves:
            leaf.grad = None
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gpu_call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gpu_call()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        gpu_call()
        peak = torch.cuda.max_memory_allocated(device) - base
        rows.append(
            [
                "x".join(map(str, shape)),
                f"{float(cpu_values[0]):.4f} / {float(cpu_values[1]):.4f}",
                f"{float(gpu_values[0]):.4f} / {float(gpu_values[1]):.4f}",
                f"{grad_err:.1e}",
                f"{sorted(times)[len(times) // 2]:.2f}",
                kernels,
                f"{peak / 2**20:.1f}",
            ]
        )
    header = ["B x T x S x V", "CPU simple / pruned", "CUDA simple / pruned", "max grad diff (rel.)", "ms per call"]
    header += ["CUDA kernels per call", "peak MiB"]
    note = (
        "One call = smoothed simple loss with posteriors, prune ranges (s_range 5), a tanh joiner on the windows, "
        "pruned loss, backward; float32."
    )
    return markdown_table(header, rows) + "\n\n" + note


class _NullWriter:
    def add_scalar(self, tag, value, step) -> None:
        pass


def sync_counts(device: torch.device) -> str:
    tokens, data = batches(2)
    trainer = icefall_trainer([], device)
    monitor = SecondMomentMonitor(trainer.model, trainer.optimizer)
    t = trainer.training(tokens, tb_writer=_NullWriter(), second_moment=monitor)
    train_step(t, data[0].data)  # warm-up: optimizer state, cuDNN plans
    t.flush_log()
    counts: Counter = Counter()
    phase = ["step"]
    with count_host_syncs(counts, phase):
        trainer.params.batch_idx_train += 1
        info, grad_norm, clip_scale = train_step(t, data[1].data)
        phase[0] = "per-step logging"
        stats = filter_stats(t.model, t.loss_scale)
        t.second_moment.record(trainer.params.batch_idx_train)
        log_step(t, data[1].data, info, grad_norm, clip_scale, stats)
        phase[0] = "flush (every --log-interval)"
        t.flush_log()
    rows = [[p, w, n] for (p, w), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1]))]
    totals = Counter()
    for (p, _), n in counts.items():
        totals[p] += n
    summary = ", ".join(f"{p}: {n}" for p, n in totals.items())
    return markdown_table(["part", "caused in", "synchronisations"], rows) + f"\n\nTotals: {summary}."


def step_times(device: torch.device) -> str:
    tokens, data = batches(2)
    rows = []
    for precision, flags in (
        ("float32", []),
        ("float16", ["--use-fp16", "true"]),
        ("bfloat16", ["--use-bf16", "true"]),
    ):
        trainer = icefall_trainer(flags, device)
        scaler = torch.amp.GradScaler("cuda") if precision == "float16" else None
        t = trainer.training(tokens, scaler=scaler)
        for _ in range(2):
            train_step(t, data[0].data)
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(t, data[0].data)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append([precision, f"{1000 * sorted(times)[len(times) // 2]:.1f}"])
        del t, trainer
        torch.cuda.empty_cache()
    shape = f"{len(data[0].data['supervisions']['text'])} utterances, {data[0].data['inputs'].shape[1]} frames"
    lstm_rows = lstm_times(device, frames=data[0].data["inputs"].shape[1] // 4, batch=21)
    bf16_cudnn = torch.backends.cudnn.is_acceptable(torch.empty(1, dtype=torch.bfloat16, device=device))
    return (
        markdown_table(["precision", "ms per train_step (median of 6)"], rows)
        + f"\n\nOne batch: {shape}.\n\nOne icefall-preset ScaledLSTM layer (512 -> 1024, projection 512), "
        f"forward + backward on {data[0].data['inputs'].shape[1] // 4} x 21 frames (cuDNN accepts bfloat16 "
        f"tensors: {bf16_cudnn}):\n\n" + markdown_table(["autocast", "ms (median of 10)", "output dtype"], lstm_rows)
    )


def lstm_times(device: torch.device, frames: int, batch: int) -> List[List[str]]:
    lstm = ScaledLSTM(input_size=512, hidden_size=1024, proj_size=512, grad_filter_threshold=25.0).to(device)
    x = torch.randn(frames, batch, 512, device=device, requires_grad=True)
    rows = []
    for name, dtype in (("off (float32)", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        times, out_dtype = [], None
        for rep in range(12):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                out, _ = lstm(x)
            out.float().sum().backward()
            torch.cuda.synchronize()
            if rep >= 2:
                times.append(time.perf_counter() - start)
            out_dtype = out.dtype
        rows.append([name, f"{1000 * sorted(times)[len(times) // 2]:.2f}", str(out_dtype)])
    return rows


SMALL_MODEL = ["--num-encoder-layers", "2", "--encoder-dim", "64", "--rnn-hidden-size", "128"]


# Check 9's threshold for every rule of icefall_lite.train.rules.RULES, each making it act within RULE_STEPS
# steps of the small model on rule_batches() (not the ablation's thresholds: this checks the CUDA path, not the
# rule's effect). A rule added to the table without one here stops the check (KeyError).
CHECK_THRESHOLDS: Dict[str, float] = {
    "grad-filter-threshold": 1.0,
    "error-clip": 1e-5,
    "recurrent-grad-clip": 0.01,
    "clip-grad-value": 1e-3,
    "agc-clipping": 0.01,
    "clip-grad-norm": 1.0,
    "clip-grad-norm-relative": 1.0,
    "zclip-z-threshold": 0.5,
    "autoclip-percentile": 50.0,
    "scaled-adam-clipping-scale": 1.0,
}
# Every rule off but the one a row turns on: the rules whose default is not their off value (the filter then
# observes, so its statistics still come).
ALL_OFF = [item for rule in RULES if rule.default != rule.off for item in (rule.flag, f"{rule.off:g}")]


def check_rules() -> List[Tuple[str, List[str]]]:
    """Check 9's rows: a control with every rule off, then every rule of the table alone at its
    :data:`CHECK_THRESHOLDS` value (the filter in each of its modes)."""
    rows: List[Tuple[str, List[str]]] = [("none (control)", [])]
    for rule in RULES:
        value = CHECK_THRESHOLDS[rule.name]
        flags = [rule.flag, f"{value:g}"]
        if rule.name == "grad-filter-threshold":
            rows += [
                (f"{rule.name} {value:g} {mode}", [*flags, "--grad-filter-mode", mode]) for mode in GRAD_FILTER_MODES
            ]
        else:
            rows.append((f"{rule.name} {value:g}", flags))
    return rows


RULE_STEPS = 30  # ZClip acts only after its 25 warm-up norms: on the spike at step 28
# The largest relative CPU-CUDA difference of a step's loss and clip scale that passes (TF32 off: one float32
# step from the same state differs by rounding alone), and of its clipped gradients, as a multiple of the
# control's (the model's own CPU-CUDA difference; on an H100 7e-4 of the pre-clip norm).
RULE_TOLERANCE = 1e-3
GRADIENT_TOLERANCE = 5.0
CONTROL_GRADIENT_TOLERANCE = 1e-2  # the control's own, of the pre-clip norm


def _rule_run(
    flags: Sequence[str], device: torch.device, tokens: TokenTable, data: list, forced: Optional[List[dict]] = None
) -> Dict[str, Any]:
    """RULE_STEPS train_steps of the small model (no dropout) with ``flags`` on ``device``: per step the loss per
    frame, the pre-clip norm, the clip scale, whether the rule acted by its own statistic, and the gradients the
    optimizer received (on the CPU); the CUDA step time and host synchronisations of the last step. ``data``: a
    batch per step.

    Each step's starting state (weights, optimizer and rule states, the CPU generator) is recorded in
    ``"states"``; given them as ``forced``, every step starts from them instead (teacher forcing: a step on
    one device compared with the same step on another, the rounding differences of earlier steps not carried).
    """
    flags = [*SMALL_MODEL, "--dropout", "0", "--layer-dropout", "0", *ALL_OFF, *flags]
    trainer = Trainer(flags, vocab_size=500, seed=0)
    trainer.model.to(device)
    torch.manual_seed(1)  # the balancers draw on the CPU generator on either device
    t = trainer.training(tokens)
    control = trainer.grad_control
    out: Dict[str, Any] = {key: [] for key in ("losses", "norms", "scales", "acted", "grads", "states")}
    names = {p: n for n, p in trainer.model.named_parameters()}

    def keep_grads(optimizer, args, kwargs) -> None:  # the gradients the rule produced, before the update
        out["grads"].append({names[p]: p.grad.detach().clone() for p in names if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(keep_grads)
    times: List[float] = []
    syncs: Counter = Counter()
    for step in range(RULE_STEPS):
        if forced is None:
            out["states"].append(
                {
                    "model": copy.deepcopy(trainer.model.state_dict()),
                    "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
                    "control": copy.deepcopy(control.state_dict()),
                    "rng": torch.get_rng_state(),
                }
            )
        else:
            trainer.model.load_state_dict(forced[step]["model"])
            trainer.optimizer.load_state_dict(forced[step]["optimizer"])
            control.load_state_dict(copy.deepcopy(forced[step]["control"]))
            torch.set_rng_state(forced[step]["rng"])
        trainer.params.batch_idx_train += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with count_host_syncs(syncs, enabled=step == RULE_STEPS - 1 and device.type == "cuda"):
            info, grad_norm, clip_scale = train_step(t, data[step].data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        out["grads"][-1] = {n: g.cpu() for n, g in out["grads"][-1].items()}  # after the step's sync count
        # ScaledAdam's rule, ZClip and AutoClip act through the clip scale, the in-backward kinds by their counts.
        fractions = [s.fraction_filtered for s in filter_stats(trainer.model)]
        fractions += [c.fraction_clipped for c in control.error_clip_counts]
        fractions += [
            m.recurrent_clip_stats.fraction_clipped for m in trainer.model.modules() if isinstance(m, ScaledLSTM)
        ]
        acting = clip_scale < 1.0 or any(f > 0 for f in read_scalars([f for f in fractions if f is not None]))
        out["losses"].append(info["loss"] / info["frames"])
        out["norms"].append(grad_norm)
        out["scales"].append(clip_scale)
        out["acted"].append(acting)
    out["ms"] = 1000 * sorted(times[1:])[len(times[1:]) // 2]
    out["syncs"] = sum(syncs.values())
    return out


def _relative(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))


def _l2_distance(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """The L2 distance of two sets of tensors (by name, the same names)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return math.sqrt(sum(float((a[n].double() - b[n].double()).square().sum()) for n in a))


def rule_batches() -> Tuple[TokenTable, List[Batch]]:
    """RULE_STEPS batches: 4 batches of 20 s cycled, and at step 28 a spike, the 4 in one batch (a summed loss
    over 4x the frames: about twice the typical norm here, which the rules that follow the norm's history see)."""
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    args = parser.parse_args(["--max-duration", "20", "--vocab-size", "500", "--num-batches", "4"])
    tokens = TokenTable()
    data = make_batches(args, tokens)
    frames = max(b.data["inputs"].shape[1] for b in data)
    padded = [F.pad(b.data["inputs"], (0, 0, 0, frames - b.data["inputs"].shape[1]), value=-23.0) for b in data]
    supervisions = {
        "num_frames": torch.cat([b.data["supervisions"]["num_frames"] for b in data]),
        "text": [text for b in data for text in b.data["supervisions"]["text"]],
    }
    spike = Batch({"inputs": torch.cat(padded), "supervisions": supervisions}, sum(b.audio_seconds for b in data))
    return tokens, [spike if step == 27 else data[step % len(data)] for step in range(RULE_STEPS)]


def _compare_rule(
    name: str,
    flags: Sequence[str],
    device: torch.device,
    tokens: TokenTable,
    data: list,
    rows: list,
    problems: list,
    control_diff: List[float],
) -> None:
    """One rule's row of check 9 (and its problems): the CPU run, then CUDA teacher-forced on its states.
    ``control_diff``: the control's gradient difference (set by the control's row, the first)."""
    cpu = _rule_run(flags, torch.device("cpu"), tokens, data)
    cuda = _rule_run(flags, device, tokens, data, forced=cpu["states"])
    loss_diff = _relative(cpu["losses"], cuda["losses"])
    scale_diff = _relative(cpu["scales"], cuda["scales"])
    assert len(cpu["grads"]) == len(cuda["grads"]) == RULE_STEPS, "a step was skipped"
    grads_diff = max(_l2_distance(a, b) / n for a, b, n in zip(cpu["grads"], cuda["grads"], cpu["norms"]))
    acted_cpu, acted_cuda = sum(cpu["acted"]), sum(cuda["acted"])
    acted_apart = sum(a != b for a, b in zip(cpu["acted"], cuda["acted"]))
    finite = all(math.isfinite(x) for x in cuda["losses"] + cuda["norms"])
    rows.append(
        [
            name,
            " ".join(flags) or "-",
            f"{acted_cpu} / {acted_cuda} ({acted_apart})",
            f"{loss_diff:.1e}",
            f"{scale_diff:.1e}",
            f"{grads_diff:.1e}",
            f"{cuda['ms']:.1f}",
            str(cuda["syncs"]),
        ]
    )
    if not finite:
        problems.append(f"{name}: a non-finite loss or norm on CUDA")
    if flags and acted_cuda == 0:
        problems.append(f"{name}: never acted on CUDA in {RULE_STEPS} steps")
    if not flags:
        control_diff[0] = grads_diff
        if grads_diff > CONTROL_GRADIENT_TOLERANCE:
            problems.append(f"{name}: its gradients differ by more than {CONTROL_GRADIENT_TOLERANCE:g}")
    if acted_apart > 1 or max(loss_diff, scale_diff) > RULE_TOLERANCE:
        problems.append(f"{name}: CUDA differs from the CPU beyond the tolerance")
    if grads_diff > GRADIENT_TOLERANCE * control_diff[0]:
        problems.append(f"{name}: its gradients differ more than {GRADIENT_TOLERANCE:g}x the control's")


def rule_parity(device: torch.device) -> str:
    tokens, data = rule_batches()
    rows, problems = [], []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        control_diff = [math.inf]
        for name, flags in check_rules():
            _compare_rule(name, flags, device, tokens, data, rows, problems, control_diff)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    table = markdown_table(
        [
            "rule",
            "flags",
            "steps acting, CPU / CUDA (steps apart)",
            "loss, max rel. diff",
            "clip scale, max rel. diff",
            "clipped gradients, L2 diff / pre-clip norm",
            "CUDA ms per step (median)",
            "CUDA host syncs in a step",
        ],
        rows,
    )
    assert not problems, "; ".join(problems) + "\n\n" + table
    return (
        f"The small model ({' '.join(SMALL_MODEL)}, dropout 0, float32, TF32 off) trained {RULE_STEPS} steps on "
        f"the CPU with each gradient control on alone (--clip-grad-norm 0 otherwise), at thresholds that make it "
        f"act, on synthetic batches (4 of 20 s cycled, the 4 in one at step 28); then each step again on CUDA from "
        f"the CPU run's state before it (weights, optimizer and rule states, generator). Steps acting: by the "
        f"rule's own statistic (fraction filtered, rows or elements capped, else the clip scale, through which "
        f"ScaledAdam's rule, ZClip and AutoClip act); the two may decide one step apart where a decision sits "
        f"at the threshold. Differences: the largest over the steps, relative; the gradients the optimizer received "
        f"as the L2 distance over all of them divided by the step's pre-clip norm (the weights after the update "
        f"differ more: Eve's division by the root of tiny second moments magnifies rounding). "
        f"A pass needs the loss and the clip scale within {RULE_TOLERANCE:g}, the gradients within "
        f"{GRADIENT_TOLERANCE:g}x the control's and the control's within {CONTROL_GRADIENT_TOLERANCE:g}.\n\n" + table
    )


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of 2 on cuda:0 (gloo: NCCL takes one GPU per rank): one train_step where rank 1's batch
    has no finite loss, then ten --max-minutes steps where rank 0's clock runs 4x as fast as rank 1's."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    device = torch.device("cuda", 0)
    tokens, data = batches(1)
    trainer = Trainer(SMALL_MODEL, vocab_size=500, seed=0)
    trainer.model.to(device)
    batch = data[0].data
    if rank == 1:
        batch = {**batch, "inputs": torch.full_like(batch["inputs"], float("nan"))}
    t = trainer.training(tokens)
    t.model, t.world_size, t.rank = DistributedDataParallel(trainer.model, device_ids=[0]), 2, rank
    trainer.params.batch_idx_train += 1
    train_step(t, batch)
    result = {"checksum": model_checksum(t.model), "skipped": trainer.params.skipped_steps}
    params = trainer.params
    params.update(max_batches=0, max_minutes=1.0, train_seconds=0.0)
    for step in range(1, 11):
        dist.all_reduce(torch.ones(4, device=device))
        params.train_seconds += 20.0 if rank == 0 else 5.0
        if budget_spent(params):
            result["stopped_at"] = step
            break
    dist.all_reduce(torch.ones(2, device=device))  # the validation all-reduce after the stop
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def ddp_decisions(device: torch.device) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_ddp_worker, args=(port, out), nprocs=2, join=True)
        results = [json.loads(Path(out, f"{rank}.json").read_text()) for rank in (0, 1)]
    assert results[0]["checksum"] == results[1]["checksum"], "the ranks' weights differ after the step"
    assert [r["skipped"] for r in results] == [0, 0], results
    assert [r.get("stopped_at") for r in results] == [3, 3], results
    return (
        "Two ranks on one GPU (gloo). Rank 1's batch had no finite loss, rank 0's had: both stepped "
        f"(skipped steps {results[0]['skipped']} / {results[1]['skipped']}) to identical weights (checksum "
        f"{results[0]['checksum'][:16]}...). With --max-minutes 1 and rank 0's clock 4x as fast, both stopped at "
        "batch 3 and met in the validation all-reduce."
    )


def _graph_run(device: torch.device, graphs: StepGraphs, batches: List[Batch], tokens: TokenTable) -> Dict[str, Any]:
    """The icefall preset on ``batches`` with ``graphs``: each step's loss and gradient norm, the weights after,
    the steps skipped."""
    trainer = Trainer(["--model-preset", "icefall"], vocab_size=bench_gpu_step.VOCAB_SIZE, seed=0)
    trainer.model.to(device)
    t = trainer.training(tokens, graphs=graphs)
    steps = []
    for batch in batches:
        trainer.params.batch_idx_train += 1
        info, grad_norm, _ = train_step(t, batch.data)
        steps.append((read_metrics(info)["loss"], float(grad_norm)))
    t.flush_log()
    weights = {n: p.detach().double().cpu() for n, p in trainer.model.named_parameters()}
    return {"steps": steps, "weights": weights, "skipped": trainer.params.skipped_steps}


def graphed_step(device: torch.device) -> str:
    """The icefall preset's step replayed as a CUDA graph against the eager step, in float32 with TF32 off:
    GRAPH_STEPS batches of 4 x 3 s (one static shape) from the same weights, both padded alike; the graphed run
    steps eagerly WARMUP_STEPS times, captures, then replays; one batch has NaN features (every loss NaN: the
    step is skipped). Per step the loss and the gradient norm, and the weights after, within 1e-5 relative."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        tokens = TokenTable()
        batches = [bench_gpu_step.uniform_batch(4, 3.0, tokens, seed=i) for i in range(GRAPH_STEPS)]
        batches[GRAPH_NAN_STEP].data["inputs"][:] = math.nan
        eager = _graph_run(device, StepGraphs(device, start_batch=0, warmup_steps=GRAPH_STEPS), batches, tokens)
        graphs = StepGraphs(device, start_batch=0)
        graphed = _graph_run(device, graphs, batches, tokens)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert len(graphs.shapes) == 1 and all(s.graph is not None for s in graphs.shapes.values()), "no graph captured"
    assert eager["skipped"] == graphed["skipped"] == 1, (eager["skipped"], graphed["skipped"])
    rows, worst = [], 0.0
    for i, ((loss_e, norm_e), (loss_g, norm_g)) in enumerate(zip(eager["steps"], graphed["steps"])):
        how = "eager" if i < WARMUP_STEPS else ("captured" if i == WARMUP_STEPS else "replayed")
        if i == GRAPH_NAN_STEP:
            assert math.isnan(norm_e) and math.isnan(norm_g) and loss_e == loss_g == 0.0, (i, norm_e, norm_g)
            rows.append([str(i + 1), how, "NaN batch: skipped in both", "-"])
            continue
        gaps = [abs(a - b) / max(abs(b), 1e-30) for a, b in ((loss_g, loss_e), (norm_g, norm_e))]
        worst = max(worst, *gaps)
        rows.append([str(i + 1), how, f"{gaps[0]:.1e}", f"{gaps[1]:.1e}"])
    w_e, w_g = eager["weights"], graphed["weights"]
    weights = max(float((w_g[n] - w_e[n]).norm() / w_e[n].norm().clamp(min=1e-30)) for n in w_e)
    assert worst <= 1e-5 and weights <= 1e-5, f"graphed against eager: losses/norms {worst:.1e}, weights {weights:.1e}"
    table = markdown_table(["step", "graphed run", "loss, relative gap", "gradient norm, relative gap"], rows)
    return table + f"\n\nWeights after {GRAPH_STEPS} steps, largest relative L2 gap over the tensors: {weights:.1e}."


def prepare_tiny(work_dir: Path) -> None:
    proc = subprocess.run(
        ["bash", str(RECIPE / "prepare.sh"), "--size", "tiny", "--work-dir", str(work_dir)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: prepare.sh --size tiny failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def main() -> None:
    start = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="A corpus prepared by prepare.sh --size tiny --work-dir DIR (default: one is prepared in a temporary "
        "folder). Experiment folders are written into it.",
    )
    parser.add_argument(
        "--report", type=Path, default=REPO / "benchmarks" / "gpu-check.md", help="The Markdown report to write."
    )
    parser.add_argument(
        "--only",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="Run only these checks, by number (e.g. 3,4); default: all eleven.",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help="The time budget from the script's start: the check running at its end is stopped, later ones are "
        "not started (each is listed in the report). Default: %(default)s.",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - set(ORDER))
    if unknown:
        parser.error(f"--only: no check {', '.join(map(str, unknown))}; the checks are 1 to {len(ORDER)}")
    if not torch.cuda.is_available():
        sys.exit(
            f"gpu_check: no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}). This check exercises the CUDA path and needs a GPU; nothing was checked."
        )
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    if args.work_dir is None:
        prepare_tiny(work_dir)
    work_dir = work_dir.resolve()
    logs = args.report.parent / "gpu-check-logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = Report(args.report)
    props = torch.cuda.get_device_properties(device)
    report.add(
        f"# GPU check\n\n{time.strftime('%Y-%m-%d %H:%M')} UTC; {props.name} ({props.total_memory / 2**30:.0f} GiB, "
        f"compute capability {props.major}.{props.minor}); torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}; Python {sys.version.split()[0]}; command: "
        f"`python -m benchmarks.gpu_check{' --work-dir ' + str(args.work_dir) if args.work_dir else ''}"
        f"{' --only ' + ','.join(map(str, args.only)) if args.only else ''} --minutes {args.minutes:g}`; "
        f"{time.time() - start:.0f} s of the budget spent before the first check.\n"
    )
    checks: Dict[int, Tuple[str, Callable[[], str]]] = {
        1: ("LSTM output dtype under autocast", lambda: lstm_dtypes(device)),
        2: ("a non-finite gradient under the GradScaler", lambda: injected_overflow(device)),
        3: ("simple and pruned loss, CUDA against CPU", lambda: loss_parity(device)),
        4: ("host synchronisations of one training step", lambda: sync_counts(device)),
        5: ("training step time by precision", lambda: step_times(device)),
        6: (
            "train.py --preset icefall in float32, float16 (resumed), bfloat16 and float32 graphed (resumed)",
            lambda: training_runs(work_dir, logs),
        ),
        7: ("decoding on CUDA (three methods, streaming)", lambda: decoding_runs(work_dir, logs)),
        8: ("DDP decisions taken on all ranks (2 ranks)", lambda: ddp_decisions(device)),
        9: ("every gradient control, CUDA against the CPU", lambda: rule_parity(device)),
        10: ("the training step's profile (bench_gpu_step)", lambda: bench_gpu_step.report(device, reps=5)),
        11: ("the step as a CUDA graph against the eager step", lambda: graphed_step(device)),
    }
    chosen = {n: (f"{n}. {title}", check) for n, (title, check) in checks.items() if not args.only or n in args.only}
    verdict = run_checks(report, chosen, deadline=start + 60 * args.minutes)
    sys.stdout.flush()
    # os._exit: a stopped check's threads or CUDA work must not hold the exit past the budget.
    os._exit(0 if verdict == "all checks passed" else 1)


if __name__ == "__main__":
    main()
