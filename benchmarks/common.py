"""Shared plumbing of the benchmark scripts: side-by-side timing, peak memory,
machine description, Markdown tables and the section format of RESULTS.md.

Every benchmark script prints its table and, with ``--markdown-out FILE``,
writes one RESULTS.md section (title, run header, table, notes) that
``benchmarks/run_all.py`` stitches together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from icefall_lite.utils import write_text_atomic

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "egs" / "librispeech" / "ASR"

# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """``--threads`` and ``--markdown-out``, shared by every script."""
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch intra-op threads (and onnxruntime/sherpa-onnx threads where they run).",
    )
    parser.add_argument(
        "--markdown-out",
        type=Path,
        default=None,
        help="Also write this benchmark's RESULTS.md section to this file.",
    )


def setup_threads(threads: int) -> None:
    """Fix the torch thread counts for the whole run."""
    if threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def command_line() -> str:
    """The command that reproduces this run, relative to the repository root:
    the running one without ``--markdown-out FILE`` (where the section was
    written changes no number; run_all.py passes a temporary file)."""
    script = Path(sys.argv[0]).resolve()
    # The benchmarks run as modules of the package benchmarks, from the repository root.
    runner = ["-m", f"benchmarks.{script.stem}"] if script.parent == REPO / "benchmarks" else [shlex.quote(str(script))]
    args: List[str] = []
    skip_next = False
    for arg in sys.argv[1:]:
        if skip_next:
            skip_next = False
        elif arg == "--markdown-out":
            skip_next = True
        elif not arg.startswith("--markdown-out="):
            args.append(arg)
    return " ".join(["python", *runner, *(shlex.quote(a) for a in args)])


# --------------------------------------------------------------------------
# earlier versions of the library
# --------------------------------------------------------------------------


def git_show(commit: str, path: str) -> str:
    """The text of ``path`` at ``commit`` of this repository (``git show``); exits with a message if git cannot."""
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        raise SystemExit(
            f"cannot read {path} at commit {commit} with git ({detail.strip()}); run the benchmark in a git "
            "clone of the repository with its history (not a shallow clone or an archive)."
        ) from err


def load_modules_at(commit: str, paths: Sequence[str], alias: str) -> Dict[str, types.ModuleType]:
    """Import modules of this repository as they were at ``commit``, next to today's.

    Each ``icefall_lite/.../name.py`` is executed from ``git show`` as module
    ``alias.name``; imports of one of the listed modules by another (``from
    icefall_lite.nn.name import ...``) are pointed at the loaded copy, every
    other import at today's library.

    Args:
      commit: the commit to read.
      paths: repository paths of the modules, dependencies first.
      alias: name of the package the copies are registered under in ``sys.modules``.
    Returns:
      ``name`` (file stem) -> module.
    """
    package = types.ModuleType(alias)
    package.__path__ = []  # type: ignore[attr-defined]
    sys.modules[alias] = package
    renames = {path[: -len(".py")].replace("/", "."): f"{alias}.{Path(path).stem}" for path in paths}
    modules: Dict[str, types.ModuleType] = {}
    for path in paths:
        source = git_show(commit, path)
        for old, new in renames.items():
            source = source.replace(f"from {old} import", f"from {new} import")
        name = f"{alias}.{Path(path).stem}"
        module = types.ModuleType(name)
        module.__file__ = f"{commit[:7]}:{path}"
        sys.modules[name] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        setattr(package, Path(path).stem, module)
        modules[Path(path).stem] = module
    return modules


# --------------------------------------------------------------------------
# machine
# --------------------------------------------------------------------------


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_header(threads: int) -> str:
    """One line: date, CPU model and cores, load average, torch version and threads (and GPU if used)."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    parts = [
        f"date {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"CPU {cpu_model()} ({os.cpu_count()} cores)",
        f"load average at start {load}",
        f"torch {torch.__version__}",
        f"{threads} thread(s)",
    ]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------


def sync() -> None:
    """Wait for the GPU, if one is in use."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def interleaved_times(variants: Dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Time the variants side by side: each repetition runs every variant once,
    in an order that alternates between repetitions (so drifting load hits
    all of them alike).

    Args:
      variants: name -> zero-argument callable.
      reps: timed repetitions per variant.
      warmup: untimed calls of every variant first.
    Returns:
      name -> list of ``reps`` wall times in seconds.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(timed(variants[name]))
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median of the per-repetition ratios (robust to load that drifts between repetitions)."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))


# --------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------

MEMORY_METHOD_CPU = (
    "CPU: peak of the running sum of all tensor allocations minus frees reported by the PyTorch CPU "
    "allocator (torch.profiler, profile_memory=True), counted from the start of the measured call; "
    "inputs and parameters allocated before it are not counted, their gradients are"
)
MEMORY_METHOD_CUDA = "CUDA: torch.cuda.max_memory_allocated() minus the allocation before the call"


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensor memory allocated during one call of ``fn`` (see MEMORY_METHOD_*)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
        key=lambda e: e["ts"],
    )
    current = peak = 0
    for event in memory:
        current += int(event["args"]["Bytes"])
        peak = max(peak, current)
    return peak


def memory_method() -> str:
    return MEMORY_METHOD_CUDA if torch.cuda.is_available() else MEMORY_METHOD_CPU


# --------------------------------------------------------------------------
# tables and sections
# --------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; floats are written as given (format them before)."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


@dataclass
class Section:
    """One benchmark's part of RESULTS.md."""

    title: str
    threads: int
    tables: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    command: str = field(default_factory=command_line)
    header: str = ""

    def __post_init__(self) -> None:
        if not self.header:
            self.header = machine_header(self.threads)

    def markdown(self) -> str:
        parts = [f"## {self.title}", "", f"Run: {self.header}.", "", f"Command: `{self.command}`", ""]
        for table in self.tables:
            parts += [table, ""]
        for note in self.notes:
            parts.append(f"- {note}")
        return "\n".join(parts).rstrip() + "\n"

    def emit(self, markdown_out: Optional[Path]) -> None:
        """Print the section; also write it to ``markdown_out`` if given."""
        text = self.markdown()
        print(text, flush=True)
        if markdown_out is not None:
            write_text_atomic(markdown_out, text)


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def fmt_mb(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f}"
