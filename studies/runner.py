"""What the studies share: running the recipe's scripts, telling what is finished, the time left, the
machine a run was made on, and generated sections of a study's Markdown report.

A study is a list of runs, each one or more commands of the recipe (``train.py``, ``decode.py``) run as
subprocesses. A study is resumable: what a command leaves behind (a checkpoint, a marker file, a
``wer-summary`` file) says that it has finished, so a rerun skips it. After every run the study rewrites its
report (its own README.md) from every finished run: the whole file, or (:class:`Section`) the part between
the markers ``<!-- <name>:begin (written by <script>) -->`` and ``<!-- <name>:end -->``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.utils import replace_marked_section, section_markers, write_text_atomic

# The recipe whose scripts every study runs (train.py, decode.py) and whose folders hold the corpora.
RECIPE_DIR = Path(__file__).resolve().parents[1] / "egs" / "librispeech" / "ASR"


class StudyError(RuntimeError):
    """A step of a study failed; the message says which and where its log is."""


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def decode_flags(iteration: int, method: str, avg: int = 1, use_averaged_model: bool = False) -> List[str]:
    """decode.py's flags for the weights at step ``iteration``: by default checkpoint ``iteration`` alone;
    with ``use_averaged_model``, icefall's average of the model over the steps between the ``avg``-th
    checkpoint before it and it (``--iter N --avg K --use-averaged-model true``)."""
    averaged = "true" if use_averaged_model else "false"
    return ["--iter", str(iteration), "--avg", str(avg), "--use-averaged-model", averaged, "--decoding-method", method]


def run_command(
    cmd: Sequence[str],
    cwd: Path,
    what: str,
    *,
    scripts: Optional[Path] = None,
    shown: Optional[str] = None,
    log_hint: Optional[Path] = None,
) -> float:
    """Run ``cmd`` in ``cwd``; returns its wall time in seconds; StudyError naming it when it fails.

    ``python <script> ...`` runs ``<script>`` (relative to ``scripts``, else to ``cwd``) with this
    interpreter, whose folder goes first on PATH so that the script's own subprocesses use it too.
    ``shown``: the command as logged (default: ``cmd``); ``log_hint``: where its log is, for the error.
    """
    cmd = list(cmd)
    argv = cmd
    if cmd[0] == "python":
        argv = [sys.executable, str(scripts / cmd[1]) if scripts is not None else cmd[1], *cmd[2:]]
    logging.info(f"{what}: {shown or shlex.join(cmd)}")
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    start = time.time()
    proc = subprocess.run(argv, cwd=cwd, env=env)
    elapsed = time.time() - start
    if proc.returncode != 0:
        hint = f"; see its output above and {log_hint}" if log_hint is not None else ""
        raise StudyError(f"{what} failed (exit {proc.returncode}) after {elapsed:.0f} s: {shlex.join(cmd)}{hint}")
    return elapsed


# --------------------------------------------------------------------------
# Finished results
# --------------------------------------------------------------------------


def write_json_atomic(path: Path, data: Dict) -> None:
    """``data`` as indented JSON, written under a temporary name and renamed."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Optional[Dict]:
    """The JSON object in ``path``, or None when the file does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None


def newest_wer_summary(run_dir: Path, method: str, test_set: str) -> Optional[Path]:
    """The newest ``<run_dir>/<method>/wer-summary-<test_set>-*.txt`` (decode.py's), None before decoding."""
    files = sorted((run_dir / method).glob(f"wer-summary-{test_set}-*.txt"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def iter_wer_summary(
    run_dir: Path, method: str, test_set: str, iteration: int, avg: int, use_averaged_model: bool
) -> Optional[Path]:
    """decode.py's ``wer-summary`` of ``--iter iteration --avg avg`` (averaged or not) for ``test_set``, or
    None before that decoding."""
    averaged = "-use-averaged-model"
    for path in sorted((run_dir / method).glob(f"wer-summary-{test_set}-iter-{iteration}-avg-{avg}-*.txt")):
        if path.stem.endswith(averaged) == use_averaged_model:
            return path
    return None


def decoded(
    run_dir: Path, method: str, test_sets: Sequence[str] = TEST_SETS, at: Optional[Tuple[int, int, bool]] = None
) -> bool:
    """Whether decode.py has written ``method``'s results for every test set of the run (``at``: those of
    ``(iteration, avg, use_averaged_model)``; default: any)."""
    if at is None:
        return all(newest_wer_summary(run_dir, method, t) is not None for t in test_sets)
    return all(iter_wer_summary(run_dir, method, t, *at) is not None for t in test_sets)


def read_wers(
    run_dir: Path,
    methods: Sequence[str],
    test_sets: Sequence[str] = TEST_SETS,
    at: Optional[Tuple[int, int, bool]] = None,
) -> Dict[Tuple[str, str], float]:
    """``{(method, test set): WER %}`` from the run's wer-summary files (first row: the best): those of
    ``at = (iteration, avg, use_averaged_model)``, or (``at`` None) the newest."""
    wers: Dict[Tuple[str, str], float] = {}
    for method in methods:
        for test_set in test_sets:
            path = (
                newest_wer_summary(run_dir, method, test_set)
                if at is None
                else iter_wer_summary(run_dir, method, test_set, *at)
            )
            if path is None:
                what = "" if at is None else f" at --iter {at[0]} --avg {at[1]} --use-averaged-model {at[2]}"
                raise FileNotFoundError(
                    f"no {method} wer-summary{what} for {test_set} in {run_dir / method}; decode first"
                )
            wers[(method, test_set)] = load_wer_summary(path)[0][1]
    return wers


# --------------------------------------------------------------------------
# Progress and time left
# --------------------------------------------------------------------------


class Progress:
    """Wall time of every finished item, by kind (``"run"``, ``"replay"``, ``"arm"``), for the estimate of
    the time left; ``earlier``: times of items finished before this invocation (a resumed study)."""

    def __init__(self, earlier: Optional[Dict[str, List[float]]] = None) -> None:
        self.started = time.time()
        self.seconds: Dict[str, List[float]] = {kind: list(xs) for kind, xs in (earlier or {}).items()}

    @contextlib.contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Time the block as one item of ``kind`` (not counted when it raises)."""
        start = time.time()
        yield
        self.seconds.setdefault(kind, []).append(time.time() - start)

    def mean(self, kind: str, default: float = math.nan) -> float:
        """Mean seconds of an item of ``kind``, or ``default`` before any was timed."""
        xs = self.seconds.get(kind, [])
        return sum(xs) / len(xs) if xs else default

    def eta(self, left_seconds: float) -> str:
        """``"<m> min so far; about <n> min left"``."""
        return f"{(time.time() - self.started) / 60:.1f} min so far; about {left_seconds / 60:.0f} min left"


# --------------------------------------------------------------------------
# Generated sections
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """A generated section of a Markdown file: the markers' name and the recipe script that writes it."""

    name: str
    writer: str

    def write(self, path: Path, text: str) -> None:
        """Put ``text`` between the markers of ``path`` (appended, or a new file, if absent)."""
        replace_marked_section(path, self.name, text, self.writer)

    def read(self, path: Path) -> Optional[str]:
        """The text between the markers of ``path`` (as :meth:`write` put it), None without them."""
        begin, end = section_markers(self.name, self.writer)
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        if begin not in text or end not in text:
            return None
        return text.split(begin, 1)[1].split(end, 1)[0].removeprefix("\n")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: the first ``model name`` line of ``cpuinfo`` (Linux), else what the platform
    says (``platform.processor()``), else ``"unknown"``. Runs on two CPU models round differently, so a
    paired comparison needs both runs from one model."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags_digest(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """12 hex digits of the SHA-256 of the CPU's sorted ``flags`` (Linux; "unknown" elsewhere). A virtual
    machine may report only "AMD EPYC" for several generations; their instruction sets (AVX512-BF16 or not)
    differ, and with them the rounding."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:12]
    except OSError:
        pass
    return "unknown"


def machine_record() -> Dict[str, str]:
    """What a run's numbers depend on besides its flags: the CPU model, its instruction set (as a digest of
    its flags), the CPU threads a process uses (a reduction split over 2 threads rounds otherwise than over
    1) and the torch version."""
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags_digest(),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
    }


def code_commit(root: Path = RECIPE_DIR.parents[2]) -> str:
    """The commit of the code under ``root`` (default: this checkout), with ``-dirty`` when a tracked Python or
    shell file differs from it (a study's rewritten report does not count): the code a run was made with.
    ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "*.py", "*.sh"],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def machine_summary() -> str:
    """CPU architecture and cores, torch version, GPU."""
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}"
    )


def today() -> str:
    return datetime.date.today().isoformat()
