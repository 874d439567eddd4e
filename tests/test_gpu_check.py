"""The GPU check fails clearly, not by skipping, where no CUDA GPU is visible (CI and the 2-core development
machines); on a GPU it is run by hand (``make gpu-check``)."""

import os
import subprocess
import sys

from conftest import REPO


def test_gpu_check_fails_clearly_without_a_gpu(tmp_path) -> None:
    report = tmp_path / "report.md"
    # No GPU visible to the check, on a machine with one too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--report", str(report), "--work-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # a hang's guard: 107-121 s seen on 2 cores beside other jobs
        env=env,
    )
    assert proc.returncode == 1
    assert "gpu_check: no CUDA GPU" in proc.stderr and "nothing was checked" in proc.stderr
    assert not report.exists(), "no report is written when nothing was checked"


def test_make_bench_keeps_the_gpu_report_as_its_last_section() -> None:
    from benchmarks.run_all import BENCHMARKS, gpu_section

    report = "# GPU check\n\nRun on X.\n\n## 1. first: passed (1 s)\n\n| a |\n|---|\n| 1 |\n\n**all checks passed**\n"
    section = gpu_section(report).splitlines()
    assert section[0].startswith(f"## {len(BENCHMARKS) + 1}. GPU check")
    assert "### 1. first: passed (1 s)" in section and "# GPU check" not in section
    assert section[-1] == "**all checks passed**" and "Run on X." in section
