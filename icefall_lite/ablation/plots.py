"""PNG plots of the ablation (matplotlib, Agg backend): per-step pre-clip
gradient norm per arm, per-layer GradientFilter statistics, validation and
training loss. Each figure has one panel per training set (clean, corrupted)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from icefall_lite.ablation.report import TRAINING_SETS, ArmResult  # noqa: E402
from icefall_lite.utils import atomic_output  # noqa: E402
from icefall_lite.ablation.tb_reader import Series, moving_average  # noqa: E402

ARM_COLORS = {"a": "tab:red", "b": "tab:orange", "c": "tab:blue", "d": "tab:green"}
PLOT_FILES = {
    "grad_norm": "ablation-grad-norm.png",
    "filter_fraction": "ablation-filter-fraction.png",
    "max_over_median": "ablation-max-over-median.png",
    "valid_loss": "ablation-valid-loss.png",
    "train_loss": "ablation-train-loss.png",
}


def _xy(series: Series):
    return [s for s, _ in series], [v for _, v in series]


def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _window(result: ArmResult) -> int:
    """Smoothing window: about 1/50 of the run, at least 1 step."""
    return max(1, result.steps // 50)


def _save(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` as PNG (temporary name, then rename) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def _per_set_figure(
    results: Sequence[ArmResult], draw: Callable[[object, List[ArmResult]], None], title: str, path: Path
) -> Path:
    """One panel per training set; ``draw(ax, results of that set)`` fills it."""
    fig, axes = plt.subplots(1, len(TRAINING_SETS), figsize=(6 * len(TRAINING_SETS), 4.2), squeeze=False)
    for ax, training_set in zip(axes[0], TRAINING_SETS):
        subset = [r for r in results if r.training_set == training_set]
        ax.set_title(f"{training_set} training set")
        if subset:
            draw(ax, subset)
        else:
            _no_data(ax)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_grad_norm(results: Sequence[ArmResult], path: Path) -> Path:
    """Per-step pre-clip global gradient norm of every arm (log scale)."""

    def draw(ax, subset: List[ArmResult]) -> None:
        for r in subset:
            ax.plot(*_xy(r.grad_norm), color=ARM_COLORS[r.arm.key], lw=0.7, alpha=0.8, label=r.arm.label)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("pre-clip gradient norm")
        ax.legend(fontsize=7)

    return _per_set_figure(results, draw, "Pre-clip global gradient L2 norm per step", path)


def _filter_figure(results: Sequence[ArmResult], stat: str, ylabel: str, title: str, path: Path,
                   hline: float = 0.0, log: bool = False) -> Path:
    """Rows: training sets; columns: the arms with a filter; one line per encoder layer."""
    arms = sorted({r.arm.key for r in results if r.arm.filter_on})
    ncols = max(1, len(arms))
    fig, axes = plt.subplots(len(TRAINING_SETS), ncols, figsize=(5.5 * ncols, 3.6 * len(TRAINING_SETS)), squeeze=False)
    by = {(r.training_set, r.arm.key): r for r in results}
    for i, training_set in enumerate(TRAINING_SETS):
        for j in range(ncols):
            ax = axes[i][j]
            r = by.get((training_set, arms[j])) if arms else None
            if r is None or not r.filter_layers():
                _no_data(ax, "no filter statistics")
                continue
            ax.set_title(f"{training_set}: {r.arm.label}", fontsize=9)
            for layer in r.filter_layers():
                series = moving_average(r.filter_series(layer, stat), _window(r))
                ax.plot(*_xy(series), lw=0.9, label=f"layer {layer}")
            if hline > 0:
                ax.axhline(hline, color="k", ls="--", lw=0.8, label=f"threshold {hline:g}")
            if log:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_filter_fraction(results: Sequence[ArmResult], path: Path) -> Path:
    """Per-layer fraction of sequences the GradientFilter capped (moving average)."""
    return _filter_figure(results, "fraction_filtered", "fraction of sequences filtered",
                          "GradientFilter: fraction of sequences filtered per layer (moving average)", path)


def plot_max_over_median(results: Sequence[ArmResult], path: Path, threshold: float) -> Path:
    """Per-layer largest per-sequence gradient over the batch median, with the threshold."""
    return _filter_figure(results, "max_over_median", "max / median per-sequence grad RMS",
                          "GradientFilter input: largest sequence gradient / batch median (moving average)",
                          path, hline=threshold, log=True)


def plot_valid_loss(results: Sequence[ArmResult], path: Path) -> Path:
    """Validation loss per epoch of every arm."""

    def draw(ax, subset: List[ArmResult]) -> None:
        for r in subset:
            if r.valid_loss:
                ax.plot(*_xy(r.valid_loss), marker="o", color=ARM_COLORS[r.arm.key], label=r.arm.label)
        ax.set_xlabel("epoch")
        ax.set_ylabel("validation loss per frame")
        ax.legend(fontsize=7)

    return _per_set_figure(results, draw, "Validation loss (dev-clean + dev-other) per epoch", path)


def plot_train_loss(results: Sequence[ArmResult], path: Path) -> Path:
    """Per-frame training loss per step of every arm (moving average)."""

    def draw(ax, subset: List[ArmResult]) -> None:
        for r in subset:
            series = moving_average(r.scalars.get("loss", []), _window(r))
            ax.plot(*_xy(series), color=ARM_COLORS[r.arm.key], lw=0.9, label=r.arm.label)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss per frame")
        ax.legend(fontsize=7)

    return _per_set_figure(results, draw, "Training loss (moving average)", path)


def write_plots(results: Sequence[ArmResult], out_dir: Path, threshold: float) -> Dict[str, Path]:
    """All plots into ``out_dir``; ``{kind: path}`` (file names in ``PLOT_FILES``)."""
    return {
        "grad_norm": plot_grad_norm(results, out_dir / PLOT_FILES["grad_norm"]),
        "filter_fraction": plot_filter_fraction(results, out_dir / PLOT_FILES["filter_fraction"]),
        "max_over_median": plot_max_over_median(results, out_dir / PLOT_FILES["max_over_median"], threshold),
        "valid_loss": plot_valid_loss(results, out_dir / PLOT_FILES["valid_loss"]),
        "train_loss": plot_train_loss(results, out_dir / PLOT_FILES["train_loss"]),
    }
