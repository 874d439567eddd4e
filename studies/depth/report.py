"""Where gradient outliers arise as the LSTM stack deepens: a report over runs of the ablation's `none` arm
(the filter observes only) made at several depths, one summaries folder per model.

icefall saw its explosion in a 12-layer stack (hidden 1024, projection 512), starting at layer 10, about
1000x the batch median for a few sequences, at epoch 18. This report puts the same questions to each depth:
which layer goes over the threshold first and when, how large the largest ratio is and at which step, how
often each layer is over it, and whether the model learns (greedy WER at every decoding point): one table
of the runs, then two of layers (rows, top first) by runs (columns).

  python -m studies.depth --threshold 25 "L12 d256=path/to/summaries" "L4 d256=other/summaries" \
      --plot depth-outliers.png

Each folder is an ablation ``--summaries`` folder (``<summaries>/<condition>/none/seed-<n>.json``). The
pilot's own runs (pilot.sh) and their report are this folder's README.md and depth-outliers.png.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import OUTLIER_RATIO, first_and_largest, layer_outliers, plateau_exit
from studies.ablation.plots import plot_outliers_by_depth
from studies.ablation.records import RunResult
from studies.ablation.runs import load_summaries


def load_runs(folder: Path) -> List[RunResult]:
    """Every run summary under an ablation ``--summaries`` folder (either form the ablation keeps), by path;
    FileNotFoundError when there is none."""
    runs = load_summaries(folder)
    if not runs:
        raise FileNotFoundError(f"no run summaries (seed-*.json) under {folder}: pass an ablation --summaries folder")
    return runs


def _fmt(x: float, digits: int) -> str:
    return "-" if not math.isfinite(x) else f"{x:.{digits}f}"


def _wer_cells(run: RunResult, test_sets: Sequence[str]) -> List[str]:
    cells = []
    for step in sorted(run.wer_at):
        wers = run.wer_at[step]
        cells.append(f"{step}: " + " / ".join(_fmt(wers.get(("greedy_search", t), math.nan), 2) for t in test_sets))
    return ["; ".join(cells) or "-"]


def format_report(labelled: Sequence[Tuple[str, List[RunResult]]], threshold: float) -> str:
    """Three tables: how each run learned and where its outliers arose first and largest; per layer (rows, top
    first) and run (columns), the % of steps over ``threshold`` with the first such step; and the largest
    ratio with its step."""
    test_sets = ("test-clean", "test-other")
    runs = [
        (f"{label}" + (f" s{run.key.seed}" if len(runs) > 1 else ""), run) for label, runs in labelled for run in runs
    ]
    header = [
        "model",
        "seed",
        "steps",
        "greedy WER at step: test-clean / test-other",
        "plateau exit step",
        f"first over {threshold:g}x: layer (step)",
        "largest ratio: layer (step)",
        "wall min",
    ]
    rows = []
    per_run = {}
    for name, run in runs:
        layers = {r.layer: r for r in layer_outliers(run, threshold)}
        per_run[name] = layers
        first, largest = first_and_largest(list(layers.values()))
        exit_step = plateau_exit(run)
        rows.append(
            [
                name,
                str(run.key.seed),
                str(run.steps),
                *_wer_cells(run, test_sets),
                "-" if not math.isfinite(exit_step) else str(int(exit_step)),
                first,
                largest,
                _fmt(run.wall_total_s / 60, 1),
            ]
        )
    names = [name for name, _ in runs]
    depth = max((max(layers) + 1 for layers in per_run.values() if layers), default=0)

    def matrix(cell) -> str:
        cells = [
            [str(layer)] + [cell(per_run[n][layer]) if layer in per_run[n] else "" for n in names]
            for layer in range(depth - 1, -1, -1)
        ]
        return markdown_table(["layer", *names], cells, "r" * (len(names) + 1))

    over = matrix(lambda r: f"{r.percent_over:.2f}" + ("" if r.first_over is None else f" ({r.first_over})"))
    largest = matrix(lambda r: f"{r.largest:.1f} ({r.largest_step})")
    return (
        "\n\n".join(
            [
                markdown_table(header, rows, "l" + "r" * (len(header) - 1)),
                f"% of steps (from the end of warm-up) with the layer's largest per-sequence gradient over "
                f"{threshold:g}x the batch median (the first such step):",
                over,
                "The largest ratio after warm-up (its step):",
                largest,
            ]
        )
        + "\n"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.depth", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="LABEL=SUMMARIES_FOLDER, one per model")
    parser.add_argument("--threshold", type=float, default=OUTLIER_RATIO, help="max/median counted as an outlier")
    parser.add_argument(
        "--plot", type=Path, default=None, help="also draw the outliers per layer and model into this PNG"
    )
    args = parser.parse_args(argv)
    labelled: List[Tuple[str, List[RunResult]]] = []
    for item in args.folders:
        label, sep, folder = item.partition("=")
        if not sep or not folder:
            parser.error(f"{item!r}: write LABEL=SUMMARIES_FOLDER, e.g. 'L12 d256=depth/L12-d256/runs'")
        labelled.append((label, load_runs(Path(folder))))
    print(format_report(labelled, args.threshold), end="")
    if args.plot is not None:
        plot_outliers_by_depth(labelled, args.threshold, args.plot)
