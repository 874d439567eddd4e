"""Learning curves: WER against training wall-clock minutes (``python -m studies.learning_speed.curve``).

For every ``--run LABEL=EXP_DIR`` each ``epoch-N.pt`` is decoded with greedy search (the recipe's ``decode.py
--epoch N --avg 1 --use-averaged-model false``; skipped when its wer-summary file exists) and placed at the
training minutes that train.py recorded in it. ``--csv`` adds curves measured before (``label,minutes,wer``).
The points are also written to a CSV beside the PNG. The curves of this folder (learning-curve.png and .csv):
the demo's model under the defaults before and after the learning-speed study; from egs/librispeech/ASR:

  python -m studies.learning_speed.curve \\
      --run "new defaults=lstm_transducer_stateless/exp" \\
      --csv ../../../studies/learning_speed/learning-curve-old-defaults.csv

Extra flags after ``--`` go to decode.py (e.g. model-size flags of the run).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.utils import atomic_output, script_parser, write_text_atomic
from studies.runner import RECIPE_DIR

HERE = Path(__file__).resolve().parent
# The recipe's decode.py, which decodes the runs' checkpoints.
DECODE_PY = RECIPE_DIR / "lstm_transducer_stateless" / "decode.py"

# (minutes of training, WER %) points of one run
Curve = List[Tuple[float, float]]


def epoch_training_minutes(exp_dir: Path) -> Dict[int, float]:
    """``{epoch: minutes of training up to the end of that epoch}`` from the ``train_seconds`` of
    every ``epoch-N.pt`` in ``exp_dir`` (train.py records it; validation is not counted)."""
    out = {}
    for path in exp_dir.glob("epoch-*.pt"):
        try:
            epoch = int(path.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        ckpt = load_checkpoint_file(path)
        if "train_seconds" not in ckpt:
            raise KeyError(f"{path} has no train_seconds: it was written by a train.py older than --max-minutes")
        out[epoch] = float(ckpt["train_seconds"]) / 60.0
    return dict(sorted(out.items()))


def read_curve_csv(path: Path) -> Dict[str, Curve]:
    """Curves from a CSV with the header ``label,minutes,wer`` (lines starting with # are comments)."""
    curves: Dict[str, Curve] = {}
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip() and not ln.startswith("#")]
    if not lines or lines[0].replace(" ", "") != "label,minutes,wer":
        raise ValueError(f"{path}: expected the header 'label,minutes,wer'")
    for number, line in enumerate(lines[1:], 2):
        parts = line.split(",")
        if len(parts) != 3:
            raise ValueError(f"{path}: line {number} {line!r} does not have 3 fields")
        curves.setdefault(parts[0].strip(), []).append((float(parts[1]), float(parts[2])))
    return curves


def plot_learning_curves(curves: Dict[str, Curve], path: Path, test_set: str = "test-clean") -> None:
    """One line per curve (WER % against training minutes) into the PNG ``path``, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("training wall-clock minutes (2 CPU cores)")
    ax.set_ylabel(f"{test_set} greedy WER (%)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.prog = "python -m studies.learning_speed.curve"
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
        "--output", type=Path, default=HERE / "learning-curve.png", help="the PNG (a .csv goes beside it)"
    )
    parser.add_argument("--test-set", default="test-clean", help="the test set decoded")
    parser.add_argument("--every", type=int, default=1, help="decode every N-th epoch (and always the last)")
    parser.add_argument("decode_args", nargs="*", help="extra decode.py flags (after --)")
    return parser


def wer_summary(exp_dir: Path, epoch: int, test_set: str) -> Path:
    """decode.py's greedy-search wer-summary file of ``--epoch epoch --avg 1`` for ``test_set``."""
    suffix = f"epoch-{epoch}-avg-1-context-2-max-sym-per-frame-1"
    return exp_dir / "greedy_search" / f"wer-summary-{test_set}-{suffix}.txt"


def run_curve(label: str, exp_dir: Path, test_set: str, decode_args: List[str], every: int = 1) -> Curve:
    """The curve of one run: every ``every``-th epoch (and the last) decoded, unless decoded before, and placed at
    its training minutes."""
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
                str(DECODE_PY),
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s [learning_curve] %(message)s", level=logging.INFO)
    parser = get_parser()
    args = parser.parse_args(argv)
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
            parser.exit(1, f"{parser.prog}: error: {e}\n")
    if not curves:
        parser.error("nothing to plot: give --run or --csv")
    plot_learning_curves(curves, args.output, args.test_set)
    rows = ["label,minutes,wer"] + [f"{label},{m:.2f},{w:.2f}" for label, pts in curves.items() for m, w in sorted(pts)]
    write_text_atomic(args.output.with_suffix(".csv"), "\n".join(rows) + "\n")
    logging.info(f"wrote {args.output} and {args.output.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
