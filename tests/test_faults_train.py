"""Training faults: kill -9 at any moment (including mid-checkpoint), a DDP rank that dies, NaN features
in a training cut (the step is skipped and counted in the log and TensorBoard)."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from lhotse import CutSet, load_manifest

from conftest import batch_losses, free_port, run_train, train_command, train_env, with_features
from icefall_lite.train.checkpoint import load_checkpoint_file
from studies.tb_reader import read_scalars


def _popen_train(work: Path, exp_dir: Path, stderr_path: Path, *extra: str) -> subprocess.Popen:
    """Start train.py; stderr goes to a file (a pipe nobody reads would fill up and block it)."""
    args = train_command(exp_dir, *extra)
    return subprocess.Popen(
        args,
        cwd=work,
        env=train_env(),
        stdout=subprocess.DEVNULL,
        stderr=stderr_path.open("w"),
        start_new_session=True,
    )


def test_kill_9_during_checkpointing_then_resume_matches_uninterrupted(tiny_data, six_batches, tmp_path):
    # Checkpoint after every batch, so the kill very likely lands in or near a save. The uninterrupted run
    # with the same flags: six_batches.
    exp = tmp_path / "killed"
    proc = _popen_train(tiny_data, exp, tmp_path / "killed.stderr", "--max-batches", "6", "--save-every-n", "1")
    deadline = time.time() + 300
    while not list(exp.glob("*checkpoint-3.pt*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # Every checkpoint that exists under its final name is complete.
    for path in exp.glob("checkpoint-*.pt"):
        load_checkpoint_file(path)
    resumed = run_train(tiny_data, exp, "--max-batches", "6", "--save-every-n", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert not list(exp.glob(".tmp-*")), "stale temporary checkpoint left behind"
    a = load_checkpoint_file(six_batches / "checkpoint-6.pt")
    b = load_checkpoint_file(exp / "checkpoint-6.pt")
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    losses_full, losses_resumed = batch_losses(six_batches), batch_losses(exp)
    for batch, loss in losses_resumed.items():
        assert loss == losses_full[batch], batch


def test_ddp_rank_death_stops_the_others(tiny_data, tmp_path):
    exp = tmp_path / "ddp"
    stderr_path = tmp_path / "ddp.stderr"
    proc = _popen_train(
        tiny_data,
        exp,
        stderr_path,
        "--world-size",
        "2",
        "--num-epochs",
        "50",
        "--save-every-n",
        "0",
        "--master-port",
        str(free_port()),
    )
    deadline = time.time() + 300
    log1 = None
    while time.time() < deadline and proc.poll() is None:
        logs = sorted((exp / "log").glob("log-train-*-1")) if (exp / "log").is_dir() else []
        if logs and "global batch 2," in logs[0].read_text():
            log1 = logs[0]
            break
        time.sleep(0.2)
    assert log1 is not None, "rank 1 never trained"
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ranks = []
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if "spawn_main" in cmdline:  # not the resource tracker
            ranks.append(int(pid))
    assert len(ranks) == 2, children
    killed_at = time.time()
    os.kill(max(ranks), signal.SIGKILL)  # the later-started child: rank 1
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.time() - killed_at
    assert proc.returncode != 0
    assert elapsed < 120
    stderr = stderr_path.read_text()
    assert re.search(r"process \d+ terminated with signal SIGKILL", stderr), stderr[-2000:]
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_nan_training_features_skip_the_step_counted_in_log_and_tensorboard(tiny_data, tmp_path):
    fbank = tiny_data / "data" / "fbank"
    manifests = tmp_path / "fbank"
    manifests.mkdir()
    for name in ("librispeech_cuts_dev-clean.jsonl.gz", "librispeech_cuts_dev-other.jsonl.gz", "noise_cuts.jsonl.gz"):
        (manifests / name).symlink_to(fbank / name)
    cuts = list(load_manifest(fbank / "librispeech_cuts_train-clean-100.jsonl.gz"))
    # Feature paths in the manifests are relative to the work dir; the poisoned cut's is absolute.
    cwd = os.getcwd()
    os.chdir(tiny_data)
    try:
        victim = cuts[5]
        cuts[5] = with_features(victim, np.full_like(victim.load_features(), np.nan), tmp_path / "nan_feats")
    finally:
        os.chdir(cwd)
    CutSet.from_cuts(cuts).to_file(manifests / "librispeech_cuts_train-clean-100.jsonl.gz")
    exp = tmp_path / "exp"
    proc = run_train(
        tiny_data, exp, "--manifest-dir", str(manifests), "--tensorboard", "true", "--enable-musan", "false"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = "".join(p.read_text() for p in (exp / "log").glob("log-train-*"))
    skips = re.findall(r"Skipping step at batch (\d+): (.*?) \(skipped steps so far: (\d+)\)", log)
    assert len(skips) == 1 and skips[0][2] == "1", skips  # exactly the one batch holding the victim
    assert re.search(r"Done\. Training took [\d.]+ s; skipped steps: 1\b", log), log[-2000:]
    series = read_scalars(exp / "tensorboard", ["train/skipped_steps"])["train/skipped_steps"]
    skipped_at = int(skips[0][0])
    assert series and all(v == (1.0 if step >= skipped_at else 0.0) for step, v in series), series
    final = load_checkpoint_file(exp / "epoch-1.pt")
    assert all(torch.isfinite(v).all() for v in final["model"].values() if v.is_floating_point())
