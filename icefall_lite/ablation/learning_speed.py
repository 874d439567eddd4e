"""The learning-speed study: arms, their measured results and the RESULTS.md table.

An arm is one training run of ``train.py`` under a wall-clock budget
(``--max-minutes``) with one change from the defaults, decoded with greedy
search on test-clean and test-other with the weights at the end of the budget.
The recipe script ``lstm_transducer_stateless/learning_speed.py`` runs the
arms; this module holds what is reusable: the arm description, reading a
finished arm back (the last checkpoint's progress entries and the
wer-summary files) and rendering the table.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.ablation.tb_reader import Series, moving_average, read_scalars
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.train.checkpoint import find_checkpoints, load_checkpoint_file
from icefall_lite.train.tb_tags import TrainingScalarTags

DONE_FILE = "learning-speed-done.json"
SIMPLE_LOSS_TARGET = 0.5  # per frame; the landmark of the warm-up
SIMPLE_LOSS_WINDOW = 20  # steps of the moving average


@dataclass(frozen=True)
class StudyArm:
    """One arm: a name, what it changes, and the flags that change it.

    Args:
      name: folder name under the study's exp root (``baseline``, ``no-specaug``).
      change: the change from the defaults, in words, for the table.
      train_flags: extra ``train.py`` flags.
      vocab_size: BPE vocabulary of the arm (None: the default BPE model).
      model_flags: model-size flags, given to both train.py and decode.py.
      seed: ``train.py --seed``.
    """

    name: str
    change: str
    train_flags: Tuple[str, ...] = ()
    vocab_size: Optional[int] = None
    model_flags: Tuple[str, ...] = ()
    seed: int = 42


@dataclass
class StudyResult:
    """What a finished arm measured."""

    name: str
    change: str
    steps: int
    train_seconds: float
    wall_seconds: float
    train_loss: float
    valid_loss: float
    num_parameters: int
    wers: Dict[str, float] = field(default_factory=dict)  # test set -> greedy WER %
    simple_below_target_step: Optional[int] = None  # first step where the smoothed simple loss < 0.5

    def to_json(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Dict) -> "StudyResult":
        return cls(**data)


def last_checkpoint(exp_dir: Path) -> Path:
    """The ``checkpoint-<batch>.pt`` with the highest batch in ``exp_dir`` (FileNotFoundError if none)."""
    found = find_checkpoints(exp_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint-<batch>.pt in {exp_dir}: the arm did not finish training")
    return found[0]


def read_training_progress(checkpoint: Path) -> Dict[str, float]:
    """Steps, training seconds, final train/validation loss and parameter count stored in a checkpoint."""
    ckpt = load_checkpoint_file(checkpoint)
    missing = [k for k in ("batch_idx_train", "train_seconds", "train_loss", "valid_loss") if k not in ckpt]
    if missing:
        raise KeyError(f"{checkpoint} lacks {missing}: was it written by train.py with --max-minutes?")
    return {
        "steps": int(ckpt["batch_idx_train"]),
        "train_seconds": float(ckpt["train_seconds"]),
        "train_loss": float(ckpt["train_loss"]),
        "valid_loss": float(ckpt["valid_loss"]),
        "num_parameters": int(ckpt.get("num_parameters", 0)),
    }


def read_greedy_wers(exp_dir: Path, test_sets: Sequence[str] = TEST_SETS) -> Dict[str, float]:
    """``{test set: WER %}`` from the newest ``greedy_search/wer-summary-<set>-*.txt`` of ``exp_dir``."""
    wers = {}
    for test_set in test_sets:
        files = sorted(
            (exp_dir / "greedy_search").glob(f"wer-summary-{test_set}-*.txt"), key=lambda p: p.stat().st_mtime
        )
        if not files:
            raise FileNotFoundError(f"no greedy_search wer-summary for {test_set} in {exp_dir}; decode first")
        wers[test_set] = load_wer_summary(files[-1])[0][1]
    return wers


def first_step_below(series: Series, target: float, window: int) -> Optional[int]:
    """The first step at which the ``window``-step moving average of ``series`` is below ``target``."""
    for step, value in moving_average(series, window):
        if value < target:
            return step
    return None


def simple_loss_landmark(exp_dir: Path, tags: TrainingScalarTags) -> Optional[int]:
    """First training step where the simple loss per frame (TensorBoard ``tags.simple_loss``,
    averaged over ``SIMPLE_LOSS_WINDOW`` steps) falls below ``SIMPLE_LOSS_TARGET``; None if never."""
    series = read_scalars(exp_dir / "tensorboard", [tags.simple_loss]).get(tags.simple_loss, [])
    return first_step_below(series, SIMPLE_LOSS_TARGET, SIMPLE_LOSS_WINDOW)


def seed_spread(results: Sequence[StudyResult], test_set: str) -> Optional[float]:
    """Largest minus smallest WER on ``test_set`` among ``results`` (runs of one setting, other seeds)."""
    values = [r.wers[test_set] for r in results if test_set in r.wers]
    return max(values) - min(values) if len(values) > 1 else None


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def format_table(results: Sequence[StudyResult]) -> str:
    """Markdown table, one row per arm, in the given order."""
    lines = [
        "| arm | change from the defaults | params | steps | train min | wall min | simple < 0.5 at step "
        "| train loss | valid loss | test-clean WER | test-other WER |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        landmark = "never" if r.simple_below_target_step is None else str(r.simple_below_target_step)
        lines.append(
            f"| {r.name} | {r.change} | {r.num_parameters / 1e6:.2f} M | {r.steps} | {_minutes(r.train_seconds)} "
            f"| {_minutes(r.wall_seconds)} | {landmark} | {r.train_loss:.4f} | {r.valid_loss:.4f} "
            f"| {r.wers.get('test-clean', float('nan')):.2f} | {r.wers.get('test-other', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def mean_wer(results: Sequence[StudyResult], test_set: str) -> float:
    return statistics.fmean(r.wers[test_set] for r in results)


def compare_to_baseline(
    results: Sequence[StudyResult], baselines: Sequence[StudyResult]
) -> List[Tuple[str, float, float, bool]]:
    """Per arm: (name, test-clean WER minus the baselines' mean, same for test-other, beyond the seed spread).

    A difference counts as beyond the spread when both test sets differ from
    the baseline mean by more than the baseline runs differ from each other.
    """
    base_names = {b.name for b in baselines}
    spread = {t: seed_spread(baselines, t) or 0.0 for t in TEST_SETS}
    means = {t: mean_wer(baselines, t) for t in TEST_SETS}
    rows = []
    for r in results:
        if r.name in base_names:
            continue
        deltas = [r.wers[t] - means[t] for t in TEST_SETS]
        rows.append((r.name, deltas[0], deltas[1], all(abs(d) > spread[t] for d, t in zip(deltas, TEST_SETS))))
    return rows


# --------------------------------------------------------------------------
# Learning curves: WER against training wall-clock minutes
# --------------------------------------------------------------------------

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
