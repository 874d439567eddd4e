"""benchmarks.common.command_line: the command printed in benchmarks/RESULTS.md."""

from __future__ import annotations

import sys

import pytest

from benchmarks.common import REPO, command_line


@pytest.mark.parametrize(
    "argv, expected_args",
    [
        (["--threads", "2", "--markdown-out", "/tmp/x/loss.md"], "--threads 2"),
        (["--markdown-out=/tmp/x/loss.md", "--reps", "3"], "--reps 3"),
        (["--decode-args", "--exp-dir", "a b"], "--decode-args --exp-dir 'a b'"),
    ],
)
def test_command_line_drops_the_markdown_target_and_quotes(monkeypatch, argv, expected_args):
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "bench_loss.py"), *argv])
    assert command_line() == f"python -m benchmarks.bench_loss {expected_args}"
