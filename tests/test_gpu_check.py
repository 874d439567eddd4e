"""The GPU check fails clearly, not by skipping, on a machine without a CUDA GPU (CI and the 2-core
development machines); on a GPU it is run by hand (``make gpu-check``)."""

import subprocess
import sys

import pytest
import torch

from conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run make gpu-check instead")
def test_gpu_check_fails_clearly_without_a_gpu(tmp_path) -> None:
    report = tmp_path / "report.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--report", str(report), "--work-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "gpu_check: no CUDA GPU" in proc.stderr and "nothing was checked" in proc.stderr
    assert not report.exists(), "no report is written when nothing was checked"
