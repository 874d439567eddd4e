"""Learning curves: WER against training wall-clock minutes (``lstm_transducer_stateless/learning_curve.py``):
the training minutes train.py records in every ``epoch-N.pt``, curves measured before (a CSV), the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

from icefall_lite.train.checkpoint import load_checkpoint_file

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

    from icefall_lite.utils import atomic_output

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
