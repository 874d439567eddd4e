"""The GPU check fails clearly, not by skipping, where no CUDA GPU is visible (CI and the 2-core development
machines); on a GPU it is run by hand (``make gpu-check``)."""

import os
import signal
import subprocess
import sys
import time

import pytest

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


def test_the_checks_run_in_order_within_the_budget_and_name_what_was_left(tmp_path) -> None:
    """A check still running at the budget's end is stopped (a subprocess it waits on too), the later ones are
    listed with the command that runs them; a failure does not stop the checks after it."""
    from benchmarks.gpu_check import ORDER, Report, run_checks

    ran = []

    def passes(number):
        return lambda: ran.append(number) or "fine"

    def fails():
        ran.append("fails")
        raise AssertionError("a planted failure")

    pid_file = tmp_path / "child.pid"

    def sleeps():
        ran.append("sleeps")
        code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
        subprocess.run([sys.executable, "-c", code], timeout=120)
        return "never"

    first, second, third, fourth = ORDER[:4]
    checks = {
        first: (f"{first}. passes", passes(first)),
        second: (f"{second}. fails", fails),
        third: (f"{third}. sleeps", sleeps),
        fourth: (f"{fourth}. not reached", passes(fourth)),
    }
    report = Report(tmp_path / "report.md")
    handler = signal.getsignal(signal.SIGALRM)
    start = time.time()
    verdict = run_checks(report, checks, deadline=start + 3.0)
    took = time.time() - start
    assert ran == [first, "fails", "sleeps"], "in ORDER's order, the failure did not stop the next"
    assert 2.9 <= took < 10, f"stopped at the budget, not when the 60 s child ended: {took:.1f} s"
    assert verdict == (
        f"passed: {first}; FAILED: {second}. fails; STOPPED at the time budget: {third}. sleeps; "
        f"not run (out of time): {fourth}; run them with `--only {fourth}`"
    )
    text = (tmp_path / "report.md").read_text()
    assert f"## {third}. sleeps: STOPPED at the time budget (3 s)" in text and "OutOfTime" in text
    assert f"## {second}. fails: FAILED" in text and "a planted failure" in text
    assert text.rstrip().endswith(f"**{verdict}**")
    with pytest.raises(ProcessLookupError):  # the stopped check's child was killed
        os.kill(int(pid_file.read_text()), 0)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == handler


def test_every_check_has_its_place_in_the_order() -> None:
    from benchmarks.gpu_check import ORDER

    assert sorted(ORDER) == list(range(1, 12))
    assert ORDER.index(7) > ORDER.index(6), "7 decodes 6's model"
