#!/usr/bin/env python3
"""learning-curve.png: test-clean greedy WER against training wall-clock minutes.

For every ``--run LABEL=EXP_DIR`` each ``epoch-N.pt`` is decoded with greedy
search (``decode.py --epoch N --avg 1 --use-averaged-model false``; skipped when
its wer-summary file exists) and placed at the training minutes that train.py
recorded in it. ``--csv`` adds curves measured before (``label,minutes,wer``).
The points are also written to a CSV beside the PNG.

Usage (from egs/librispeech/ASR):

  ./lstm_transducer_stateless/learning_curve.py \\
      --run "new defaults=lstm_transducer_stateless/exp" \\
      --csv lstm_transducer_stateless/learning-curve-old-defaults.csv \\
      --output learning-curve.png

Extra flags after ``--`` go to decode.py (e.g. model-size flags of the run).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.utils import script_parser, write_text_atomic
from studies.learning_curve import Curve, epoch_training_minutes, plot_learning_curves, read_curve_csv

RECIPE_DIR = Path(__file__).resolve().parents[1]


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="LABEL=EXP_DIR",
        help="a training run to decode epoch by epoch (repeatable)",
    )
    parser.add_argument(
        "--csv",
        action="append",
        default=[],
        type=Path,
        help="curves measured before: a CSV with the header label,minutes,wer (repeatable)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("learning-curve.png"), help="the PNG (a .csv goes beside it)"
    )
    parser.add_argument("--test-set", default="test-clean", help="the test set decoded")
    parser.add_argument("--every", type=int, default=1, help="decode every N-th epoch (and always the last)")
    parser.add_argument("decode_args", nargs="*", help="extra decode.py flags (after --)")
    return parser


def wer_summary(exp_dir: Path, epoch: int, test_set: str) -> Path:
    suffix = f"epoch-{epoch}-avg-1-context-2-max-sym-per-frame-1"
    return exp_dir / "greedy_search" / f"wer-summary-{test_set}-{suffix}.txt"


def run_curve(label: str, exp_dir: Path, test_set: str, decode_args: List[str], every: int = 1) -> Curve:
    minutes = epoch_training_minutes(exp_dir)
    if not minutes:
        raise FileNotFoundError(f"no epoch-*.pt in {exp_dir} for the run {label!r}")
    last = max(minutes)
    points = []
    for epoch, mins in minutes.items():
        if epoch % every != 0 and epoch != last:
            continue
        summary = wer_summary(exp_dir, epoch, test_set)
        if not summary.is_file():
            cmd = [
                sys.executable,
                str(RECIPE_DIR / "lstm_transducer_stateless" / "decode.py"),
                "--exp-dir",
                str(exp_dir),
                "--epoch",
                str(epoch),
                "--avg",
                "1",
                "--use-averaged-model",
                "false",
                "--decoding-method",
                "greedy_search",
                "--test-sets",
                test_set,
                *decode_args,
            ]
            logging.info(f"{label}: decoding epoch {epoch}")
            subprocess.run(cmd, check=True, capture_output=True)
        points.append((mins, load_wer_summary(summary)[0][1]))
        logging.info(f"{label}: epoch {epoch}, {mins:.1f} min, WER {points[-1][1]:.2f}")
    return points


def main() -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s [learning_curve.py] %(message)s", level=logging.INFO)
    parser = get_parser()
    args = parser.parse_args()
    if args.every < 1:
        parser.error(f"--every must be >= 1, got {args.every}")
    curves: Dict[str, Curve] = {}
    for path in args.csv:
        curves.update(read_curve_csv(path))
    for spec in args.run:
        label, sep, exp_dir = spec.partition("=")
        if not sep or not label or not exp_dir:
            parser.error(f"--run takes LABEL=EXP_DIR, got {spec!r}")
        if "," in label:
            parser.error(
                f"--run {spec!r}: the label must not contain a comma (the CSV beside the PNG is label,minutes,wer)"
            )
        try:
            curves[label] = run_curve(label, Path(exp_dir), args.test_set, args.decode_args, args.every)
        except (FileNotFoundError, KeyError, subprocess.CalledProcessError) as e:
            parser.exit(1, f"learning_curve.py: error: {e}\n")
    if not curves:
        parser.error("nothing to plot: give --run or --csv")
    plot_learning_curves(curves, args.output, args.test_set)
    rows = ["label,minutes,wer"] + [f"{label},{m:.2f},{w:.2f}" for label, pts in curves.items() for m, w in sorted(pts)]
    write_text_atomic(args.output.with_suffix(".csv"), "\n".join(rows) + "\n")
    logging.info(f"wrote {args.output} and {args.output.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
