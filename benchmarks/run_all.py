#!/usr/bin/env python3
"""Run all eleven benchmarks and rewrite benchmarks/RESULTS.md.

Each benchmark runs in its own process (so peak-memory accounting and thread
settings do not leak between them) with ``--markdown-out``; the sections are
stitched into RESULTS.md in order, which is written only when every benchmark
finished; the GPU check's last report (benchmarks/gpu-check.md, ``make gpu-check``)
follows them. About 5 minutes on an idle 2-core machine with the default model
and test-clean (4 min 24 s measured 2026-11-23; half of it the decoding
benchmark).

Usage (from the repository root; ``make bench`` does this):
  python -m benchmarks.run_all
  python -m benchmarks.run_all --only loss filter          # some of them, RESULTS.md untouched
  python -m benchmarks.run_all --decode-args --epoch 3 --avg 1 --exp-dir /tmp/exp ...   # must come last
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from icefall_lite.utils import script_parser, write_text_atomic

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "RESULTS.md"
# Written by benchmarks/gpu_check.py (make gpu-check, on a CUDA GPU); make bench copies it in as the last section.
GPU_REPORT = BENCH_DIR / "gpu-check.md"

# name -> script; the order of the sections in RESULTS.md
BENCHMARKS: Dict[str, str] = {
    "loss": "bench_loss.py",
    "scaling": "bench_loss_scaling.py",
    "filter": "bench_filter.py",
    "throughput": "bench_throughput.py",
    "decode": "bench_decode.py",
    "recursion": "bench_recursion.py",
    "versions": "bench_loss_versions.py",
    "precision": "bench_precision.py",
    "real-batches": "bench_real_batches.py",
    "recurrent-clip": "bench_recurrent_clip.py",
    "pretrained": "bench_pretrained.py",
}

PREAMBLE = """# Benchmarks

Written by `{command}` (`make bench`), {date}. Every section says when, on
which machine, with which torch and how many threads it ran, and the exact
command that reproduces it alone. Timings are side-by-side ratios: the compared
variants run interleaved in one process and the tables give medians; absolute
times depend on the machine's load (the load average at the start of each run
is given).
"""


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(BENCHMARKS),
        default=None,
        help="Run only these benchmarks and print them; RESULTS.md is not rewritten.",
    )
    parser.add_argument("--threads", type=int, default=2, help="Threads for every benchmark. (default: 2)")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="Where to write the results. (default: benchmarks/RESULTS.md)"
    )
    parser.add_argument(
        "--decode-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="Extra arguments of bench_decode.py (model, checkpoints, cuts); must come last.",
    )
    return parser


def run_one(name: str, threads: int, extra: Sequence[str], out: Path) -> None:
    command = [
        sys.executable,
        "-m",
        f"benchmarks.{Path(BENCHMARKS[name]).stem}",
        "--threads",
        str(threads),
        "--markdown-out",
        str(out),
        *extra,
    ]
    print(f"== {name}: {' '.join(command)}", flush=True)
    subprocess.run(command, cwd=REPO, check=True)


def gpu_section(report: str) -> str:
    """The GPU check's report as the last section of RESULTS.md: its title numbered after the benchmarks,
    every heading one level down."""
    title = f"## {len(BENCHMARKS) + 1}. GPU check (`make gpu-check`, on a GPU; not run by `make bench`)"
    lines = report.splitlines()
    body = ["#" + line if line.startswith("## ") else line for line in lines if not line.startswith("# ")]
    return "\n".join([title, *body]) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = get_parser().parse_args(argv)
    names: List[str] = args.only or list(BENCHMARKS)
    sections: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.md"
            try:
                run_one(name, args.threads, args.decode_args if name == "decode" else [], out)
            except subprocess.CalledProcessError as e:
                raise SystemExit(
                    f"run_all.py: benchmark {name} failed (exit status {e.returncode}); {args.results} left as it was"
                )
            sections.append(out.read_text())
    if args.only:
        return
    command = "python -m benchmarks.run_all" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    text = PREAMBLE.format(command=command, date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
    text += "\n" + "\n".join(sections)
    if GPU_REPORT.exists():
        text += "\n" + gpu_section(GPU_REPORT.read_text())
    write_text_atomic(args.results, text)
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
