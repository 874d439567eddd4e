"""The gradient-control ablation's results: what one finished run measured
(from its TensorBoard scalars and wer-summary files, kept as a small JSON
summary beside RESULTS.md so that the report outlives the run folders), the
spread over seeds, the table, where per-sequence gradient outliers arise, the
paired differences between arms and the RESULTS.md section.

Differences between arms are paired by seed (a seed fixes initialisation and
batch order in every arm): the per-seed difference from the arm without any
control, its mean, 95% interval and paired t-test p-value, with Holm's
adjustment over the family of comparisons that have at least
:data:`MIN_FAMILY_SEEDS` seeds (:mod:`icefall_lite.ablation.paired`).

The recipe's ``lstm_transducer_stateless/ablation.py`` runs the arms
(:mod:`icefall_lite.ablation.arms`) and the replayed outlier events
(:mod:`icefall_lite.ablation.replay`) and hands the results here; the plots
are in :mod:`icefall_lite.ablation.plots`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from icefall_lite.ablation.arms import Arm, RunKey
from icefall_lite.ablation.paired import PairedDifference, holm_adjust, paired_difference
from icefall_lite.ablation.tb_reader import Series, read_scalars, values
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.train.optimizer_state import EVENT_JUMP
from icefall_lite.train.tb_tags import TrainingScalarTags
from icefall_lite.utils import replace_marked_section, write_text_atomic

SECTION = "ablation"
WRITER = "lstm_transducer_stateless/ablation.py"
DONE_MARKER = "ablation-done.json"
WALL_FILE = "ablation-wall.json"
# The losses below are of the transducer objective after warm-up, 0.5 x simple +
# pruned per frame, whatever weights the warm-up ramp gave them at the step.
OBJECTIVE_SIMPLE_SCALE = 0.5
# Loss spikes: a step after warm-up whose objective is more than SPIKE_FACTOR times the median of the (up to)
# SPIKE_WINDOW steps before it that are also after warm-up (at least SPIKE_MIN_WINDOW of them).
SPIKE_FACTOR = 2.0
SPIKE_WINDOW = 50
SPIKE_MIN_WINDOW = 10
# Divergence: training loss (mean of the last DIVERGE_WINDOW steps) more than
# DIVERGE_FACTOR times its lowest such mean earlier in the run, or a skipped
# (non-finite) step.
DIVERGE_FACTOR = 1.5
DIVERGE_WINDOW = 20
# An outlier step: some layer's largest per-sequence gradient RMS above OUTLIER_RATIO x the batch median
# (the recipe's and icefall's filter threshold).
OUTLIER_RATIO = 25.0
# Paired differences with at least this many seeds form the family Holm's adjustment controls.
MIN_FAMILY_SEEDS = 3
FAMILY_ALPHA = 0.05
# icefall's ablation (lstm_transducer_stateless3, 960 h, 40 epochs, epoch 40 avg 15; greedy search):
ICEFALL_GREEDY = {"no filter": (3.79, 9.71), "GradientFilter 25": (3.66, 9.51)}
# The scalars a run summary keeps (TrainingScalarTags fields).
KEPT_SCALARS = (
    "simple_loss",
    "pruned_loss",
    "grad_norm",
    "clip_scale",
    "skipped_steps",
    "valid_loss",
    "exp_avg_sq_jump",
    "exp_avg_sq_recovery",
)
KEPT_FILTER_STATS = ("max_over_median", "fraction_filtered")


# --------------------------------------------------------------------------
# Files of a run
# --------------------------------------------------------------------------


def write_json_atomic(path: Path, data: Dict) -> None:
    """``data`` as indented JSON, written under a temporary name and renamed."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Optional[Dict]:
    """The JSON object in ``path``, or None when the file does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None


def add_wall_time(run_dir: Path, phase: str, seconds: float) -> Dict[str, float]:
    """Add ``seconds`` to ``phase`` in the run's wall-time file (kept across reruns)."""
    wall = read_json(run_dir / WALL_FILE) or {}
    wall[phase] = wall.get(phase, 0.0) + seconds
    write_json_atomic(run_dir / WALL_FILE, wall)
    return wall


def newest_wer_summary(run_dir: Path, method: str, test_set: str) -> Optional[Path]:
    """The newest ``<run_dir>/<method>/wer-summary-<test_set>-*.txt``."""
    files = sorted((run_dir / method).glob(f"wer-summary-{test_set}-*.txt"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def read_wers(run_dir: Path, methods: Sequence[str]) -> Dict[Tuple[str, str], float]:
    """``{(method, test set): WER}`` from the run's wer-summary files (first row: the best)."""
    wers: Dict[Tuple[str, str], float] = {}
    for method in methods:
        for test_set in TEST_SETS:
            path = newest_wer_summary(run_dir, method, test_set)
            if path is None:
                raise FileNotFoundError(f"no {method} wer-summary for {test_set} in {run_dir / method}; decode first")
            wers[(method, test_set)] = load_wer_summary(path)[0][1]
    return wers


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one finished run (condition x arm x seed) measured.

    ``scalars``: ``{TrainingScalarTags field: series}`` (:data:`KEPT_SCALARS`); ``filters``:
    ``{(layer, stat): series}`` of the per-layer GradientFilter statistics (the observing filter's too);
    ``warm_end``: the first step at the full loss weights.
    """

    key: RunKey
    wer: Dict[Tuple[str, str], float]
    scalars: Dict[str, Series]
    filters: Dict[Tuple[int, str], Series] = field(default_factory=dict)
    wall_s: Dict[str, float] = field(default_factory=dict)
    warm_end: int = 0

    def series(self, name: str) -> Series:
        return self.scalars.get(name, [])

    @property
    def steps(self) -> int:
        grad_norm = self.series("grad_norm")
        return grad_norm[-1][0] if grad_norm else 0

    def objective(self) -> Series:
        """``[(step, 0.5 x simple + pruned loss per frame)]``: the training loss after warm-up."""
        pruned = dict(self.series("pruned_loss"))
        return [
            (step, OBJECTIVE_SIMPLE_SCALE * simple + pruned[step])
            for step, simple in self.series("simple_loss")
            if step in pruned
        ]

    def layers(self) -> List[int]:
        return sorted({layer for layer, _ in self.filters})

    def filter_series(self, layer: int, stat: str) -> Series:
        return self.filters.get((layer, stat), [])

    def largest_ratio_per_step(self) -> Series:
        """``[(step, max over layers of max/median)]``."""
        by_step: Dict[int, float] = {}
        for layer in self.layers():
            for step, v in self.filter_series(layer, "max_over_median"):
                by_step[step] = max(by_step.get(step, v), v)
        return sorted(by_step.items())

    def to_json(self) -> Dict:
        return {
            "key": {"condition": self.key.condition, "arm": self.key.arm, "seed": self.key.seed},
            "wer": [[m, t, v] for (m, t), v in self.wer.items()],
            "scalars": {k: _rounded(v) for k, v in self.scalars.items()},
            "filters": [[layer, stat, _rounded(v)] for (layer, stat), v in self.filters.items()],
            "wall_s": self.wall_s,
            "warm_end": self.warm_end,
        }

    @staticmethod
    def from_json(data: Dict) -> "RunResult":
        return RunResult(
            RunKey(**data["key"]),
            {(m, t): v for m, t, v in data["wer"]},
            {k: [(int(s), float(v)) for s, v in series] for k, series in data["scalars"].items()},
            {(int(layer), stat): [(int(s), float(v)) for s, v in series] for layer, stat, series in data["filters"]},
            dict(data["wall_s"]),
            int(data["warm_end"]),
        )


def _rounded(series: Series) -> List[List[float]]:
    """7 significant digits (the float32 TensorBoard values need no more); non-finite values as strings."""
    return [[s, float(f"{v:.7g}") if math.isfinite(v) else str(v)] for s, v in series]


def summary_path(summaries_dir: Path, key) -> Path:
    """Where the summary of a run or a replay (``key``: a RunKey or a ReplayKey) is kept:
    ``<summaries_dir>/<key.relpath>.json``."""
    return summaries_dir / f"{key.relpath}.json"


def write_summary(summaries_dir: Path, result) -> Path:
    """The summary of a run or a replay (a RunResult or a ReplayResult: ``key`` and ``to_json()``)."""
    path = summary_path(summaries_dir, result.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    return path


def read_summary(summaries_dir: Path, key: RunKey) -> Optional[RunResult]:
    """The run's summary, or None when it has none yet."""
    data = read_json(summary_path(summaries_dir, key))
    return None if data is None else RunResult.from_json(data)


def kept_scalars(
    scalars: Dict[str, Series], tags: TrainingScalarTags
) -> Tuple[Dict[str, Series], Dict[Tuple[int, str], Series]]:
    """The scalars a summary keeps, by TrainingScalarTags field, and the per-layer filter statistics."""
    wanted = {name: scalars[getattr(tags, name)] for name in KEPT_SCALARS if getattr(tags, name) in scalars}
    filters = {}
    for tag, series in scalars.items():
        layer_stat = tags.parse_filter_tag(tag)
        if layer_stat is not None and layer_stat[1] in KEPT_FILTER_STATS:
            filters[layer_stat] = series
    return wanted, filters


def collect_run(
    run_dir: Path, key: RunKey, methods: Sequence[str], tags: TrainingScalarTags, warm_end: int
) -> RunResult:
    """Read a finished run: WERs, the scalars kept (with the per-layer filter stats), wall time."""
    wanted, filters = kept_scalars(read_scalars(run_dir / "tensorboard"), tags)
    return RunResult(key, read_wers(run_dir, methods), wanted, filters, read_json(run_dir / WALL_FILE) or {}, warm_end)


# --------------------------------------------------------------------------
# Metrics of a run
# --------------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``; nan when empty."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def loss_spikes(loss: Series, start: int = 0, factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW) -> int:
    """Steps after ``start`` whose loss is more than ``factor`` x the median of the (up to) ``window`` losses
    before it that are also after ``start``, once there are at least SPIKE_MIN_WINDOW (a non-finite loss
    counts as a spike)."""
    xs = [v for step, v in loss if step > start]
    count = 0
    for i in range(SPIKE_MIN_WINDOW, len(xs)):
        before = [x for x in xs[max(0, i - window) : i] if math.isfinite(x)]
        if not math.isfinite(xs[i]) or (before and xs[i] > factor * statistics.median(before)):
            count += 1
    return count


def diverged(loss: Series, skipped_steps: int, factor: float = DIVERGE_FACTOR, window: int = DIVERGE_WINDOW) -> bool:
    """A skipped (non-finite) step, or a final loss (mean of the last ``window`` steps) above ``factor`` x the
    lowest such mean earlier in the run."""
    xs = [v for _, v in loss]
    if skipped_steps > 0 or any(not math.isfinite(x) for x in xs):
        return True
    if len(xs) < 2 * window:
        return False
    means = [sum(xs[i - window : i]) / window for i in range(window, len(xs) + 1)]
    return means[-1] > factor * min(means)


def _fraction(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def steps_filtered(result: RunResult) -> float:
    """Fraction of steps at which some layer's filter capped a sequence."""
    by_step: Dict[int, float] = {}
    for layer in result.layers():
        for step, v in result.filter_series(layer, "fraction_filtered"):
            by_step[step] = max(by_step.get(step, 0.0), v)
    return _fraction([v > 0 for v in by_step.values()])


def steps_clipped(result: RunResult) -> float:
    """Fraction of steps whose gradient the clipping (norm, relative norm, value or AGC) changed: clip scale
    (post- over pre-clip norm) below 1 (always 1 without such clipping)."""
    return _fraction([x < 1.0 for x in values(result.series("clip_scale"))])


def outlier_steps(result: RunResult, ratio: float = OUTLIER_RATIO) -> float:
    """Fraction of the steps after warm-up at which some layer's largest sequence gradient was above
    ``ratio`` x the batch median."""
    return _fraction([v > ratio for s, v in result.largest_ratio_per_step() if s >= result.warm_end])


def largest_outlier(result: RunResult) -> float:
    """The largest per-sequence gradient RMS over the batch median, any layer, any step."""
    xs = values(result.largest_ratio_per_step())
    return max(xs) if xs else float("nan")


def largest_jump(result: RunResult) -> float:
    """The largest second-moment jump after warm-up (optimizer_state: a tensor's exp_avg_sq after / before)."""
    xs = [v for s, v in result.series("exp_avg_sq_jump") if s >= result.warm_end and math.isfinite(v)]
    return max(xs) if xs else float("nan")


def jump_steps(result: RunResult) -> float:
    """Fraction of the steps after warm-up with a second-moment jump above EVENT_JUMP."""
    return _fraction([v > EVENT_JUMP for s, v in result.series("exp_avg_sq_jump") if s >= result.warm_end])


def recovery_steps(result: RunResult) -> float:
    """Median steps an inflated tensor took to recover (events ending after warm-up); nan when none."""
    xs = [v for s, v in result.series("exp_avg_sq_recovery") if s >= result.warm_end]
    return statistics.median(xs) if xs else float("nan")


def final_train_loss(result: RunResult) -> float:
    """Mean objective per frame over the last tenth of the steps (at least 10)."""
    xs = values(result.objective())
    tail = xs[-max(10, len(xs) // 10) :]
    return sum(tail) / len(tail) if tail else float("nan")


def skipped_steps(result: RunResult) -> int:
    s = result.series("skipped_steps")
    return int(s[-1][1]) if s else 0


def valid_loss(result: RunResult) -> float:
    s = result.series("valid_loss")
    return s[-1][1] if s else float("nan")


@dataclass(frozen=True)
class Metric:
    """A number per run, its column header and how it is printed."""

    name: str
    header: str
    of: Callable[[RunResult], float]
    digits: int
    count: bool = False  # a yes/no per run, shown as "<runs with yes>/<runs>"

    def cell(self, runs: Sequence[RunResult]) -> str:
        xs = [self.of(r) for r in runs]
        if self.count:
            return f"{int(sum(xs))}/{len(xs)}"
        spread = Spread.of(xs)
        missing = f" (n={spread.n})" if 0 < spread.n < len(xs) else ""
        return spread.cell(self.digits) + missing


def wer_metrics(methods: Sequence[str]) -> List[Metric]:
    return [
        Metric(f"wer/{m}/{t}", f"{m.replace('_search', '')} {t}", (lambda r, m=m, t=t: r.wer[(m, t)]), 2)
        for m in methods
        for t in TEST_SETS
    ]


def metrics(methods: Sequence[str]) -> List[Metric]:
    """The table's columns: WERs, losses, spikes, divergence, outliers, filtering and clipping, the second
    moment, wall time."""
    return wer_metrics(methods) + [
        Metric("train_loss", "final train loss", final_train_loss, 3),
        Metric("valid_loss", "valid loss", valid_loss, 3),
        Metric("spikes", "loss spikes", lambda r: float(loss_spikes(r.objective(), r.warm_end)), 1),
        Metric("diverged", "diverged runs", lambda r: float(diverged(r.objective(), skipped_steps(r))), 0, True),
        Metric("outliers", f"% steps > {OUTLIER_RATIO:g}x", lambda r: 100 * outlier_steps(r), 1),
        Metric("outlier", "max seq grad / median", largest_outlier, 1),
        Metric("filtered", "% steps filtered", lambda r: 100 * steps_filtered(r), 1),
        Metric("clipped", "% steps clipped", lambda r: 100 * steps_clipped(r), 1),
        Metric("jump", "max exp_avg_sq jump", largest_jump, 2),
        Metric("jumps", f"% steps jump > {EVENT_JUMP:g}", lambda r: 100 * jump_steps(r), 1),
        Metric("recovery", "recovery steps", recovery_steps, 0),
        Metric("wall", "wall min", lambda r: sum(r.wall_s.values()) / 60, 1),
    ]


# --------------------------------------------------------------------------
# Over seeds
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """Mean, standard deviation, minimum and maximum of a metric over seeds (finite values)."""

    mean: float
    std: float
    low: float
    high: float
    n: int

    @staticmethod
    def of(xs: Sequence[float]) -> "Spread":
        xs = [x for x in xs if math.isfinite(x)]
        if not xs:
            return Spread(float("nan"), float("nan"), float("nan"), float("nan"), 0)
        std = statistics.stdev(xs) if len(xs) > 1 else float("nan")
        return Spread(statistics.mean(xs), std, min(xs), max(xs), len(xs))

    def cell(self, digits: int) -> str:
        if self.n == 0:
            return "-"
        if self.n == 1:
            return _num(self.mean, digits)
        return f"{_num(self.mean, digits)} ± {_num(self.std, digits)}"


def _num(x: float, digits: int) -> str:
    """``digits`` decimals; 3 significant digits from 10,000 on (outlier ratios reach 1e9)."""
    if math.isnan(x):
        return "-"
    return f"{x:.3g}" if abs(x) >= 1e4 else f"{x:.{digits}f}"


Group = Dict[Tuple[str, str], List[RunResult]]


def group_runs(results: Sequence[RunResult]) -> Group:
    """``{(condition, arm): [runs, one per seed]}`` in the order of ``results``."""
    groups: Group = {}
    for r in results:
        groups.setdefault((r.key.condition, r.key.arm), []).append(r)
    return groups


def format_table(results: Sequence[RunResult], arms: Dict[str, Arm], methods: Sequence[str]) -> str:
    """One row per condition x arm: mean ± standard deviation over the seeds of every metric."""
    ms = metrics(methods)
    header = ["condition", "arm", "seeds", "steps"] + [m.header for m in ms]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for (condition, arm), runs in group_runs(results).items():
        steps = sorted({r.steps for r in runs})
        cells = [
            condition,
            arms[arm].label,
            ", ".join(str(r.key.seed) for r in runs),
            "/".join(str(x) for x in steps),
        ] + [m.cell(runs) for m in ms]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Where outliers arise (arms whose filter only observes)
# --------------------------------------------------------------------------


def outlier_rows(runs: Sequence[RunResult], thresholds: Sequence[float]) -> List[Dict[str, float]]:
    """Per layer, top layer first, over the steps after warm-up of ``runs``: median, 99th percentile and
    maximum of max/median, and the percentage of those steps above each threshold."""
    layers = sorted({layer for r in runs for layer in r.layers()}, reverse=True)
    rows = []
    for layer in layers:
        xs = [
            v
            for r in runs
            for s, v in r.filter_series(layer, "max_over_median")
            if s >= r.warm_end and math.isfinite(v)
        ]
        row = {
            "layer": float(layer),
            "median": percentile(xs, 50),
            "p99": percentile(xs, 99),
            "max": max(xs) if xs else float("nan"),
        }
        for t in thresholds:
            row[f"over {t:g}"] = 100 * sum(1 for x in xs if x > t) / len(xs) if xs else float("nan")
        rows.append(row)
    return rows


def format_outlier_table(rows: Sequence[Dict[str, float]], thresholds: Sequence[float]) -> str:
    header = ["layer", "max/median: median", "99th percentile", "max"] + [f"% steps over {t:g}" for t in thresholds]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    for row in rows:
        cells = [str(int(row["layer"])), _num(row["median"], 2), _num(row["p99"], 1), _num(row["max"], 1)]
        cells += [f"{row[f'over {t:g}']:.2f}" for t in thresholds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Paired differences
# --------------------------------------------------------------------------


@dataclass
class Comparison:
    """``arm - baseline`` of one metric in one condition, paired by seed; ``holm_p``: Holm-adjusted p within
    the family (nan outside it)."""

    condition: str
    arm: str
    metric: Metric
    per_seed: Dict[int, float]
    difference: PairedDifference
    holm_p: float = float("nan")

    @property
    def in_family(self) -> bool:
        return self.difference.n >= MIN_FAMILY_SEEDS


def paired_comparisons(
    results: Sequence[RunResult], methods: Sequence[str], baseline: str = "none"
) -> List[Comparison]:
    """Every arm against ``baseline`` in its condition, for every WER and the validation loss; Holm's
    adjustment over the WER comparisons with at least MIN_FAMILY_SEEDS paired seeds (all conditions)."""
    ms = wer_metrics(methods) + [Metric("valid_loss", "valid loss", valid_loss, 3)]
    groups = group_runs(results)
    out: List[Comparison] = []
    for (condition, arm), runs in groups.items():
        if arm == baseline or (condition, baseline) not in groups:
            continue
        base = {r.key.seed: r for r in groups[(condition, baseline)]}
        for m in ms:
            mine = {r.key.seed: m.of(r) for r in runs if r.key.seed in base}
            theirs = {seed: m.of(base[seed]) for seed in mine}
            diffs = {seed: mine[seed] - theirs[seed] for seed in mine}
            out.append(Comparison(condition, arm, m, diffs, paired_difference(mine, theirs)))
    family = [c for c in out if c.in_family and c.metric.name.startswith("wer/")]
    for c, p in zip(family, holm_adjust([c.difference.p for c in family])):
        c.holm_p = p
    return out


def _p(x: float) -> str:
    return "-" if math.isnan(x) else (f"{x:.3f}" if x >= 0.001 else "<0.001")


def format_comparisons(comparisons: Sequence[Comparison], arms: Dict[str, Arm]) -> str:
    header = ["condition", "arm", "metric", "per-seed differences", "mean", "95% interval", "p", "Holm p"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for c in comparisons:
        d, digits = c.difference, c.metric.digits
        per_seed = ", ".join(f"{v:+.{digits}f}" for _, v in sorted(c.per_seed.items()))
        cells = [
            c.condition,
            arms[c.arm].label,
            c.metric.header,
            per_seed,
            "-" if math.isnan(d.mean) else f"{d.mean:+.{digits}f}",
            d.interval(digits),
            _p(d.p),
            _p(c.holm_p) if c.in_family and c.metric.name.startswith("wer/") else "not in family",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def findings(comparisons: Sequence[Comparison], arms: Dict[str, Arm], alpha: float = FAMILY_ALPHA) -> List[str]:
    """One plain sentence per arm and condition: which WER differences hold after Holm's adjustment."""
    by_arm: Dict[Tuple[str, str], List[Comparison]] = {}
    for c in comparisons:
        if c.metric.name.startswith("wer/"):
            by_arm.setdefault((c.condition, c.arm), []).append(c)
    lines = []
    for (condition, arm), cs in by_arm.items():
        held = [c for c in cs if c.in_family and c.holm_p <= alpha]
        parts = [f"{c.metric.header} {c.difference.mean:+.2f} {c.difference.interval(2)}" for c in cs]
        if held:
            verdict = "holds after Holm's adjustment: " + ", ".join(
                f"{c.metric.header} ({'lower' if c.difference.mean < 0 else 'higher'} WER)" for c in held
            )
        elif all(not c.in_family for c in cs):
            verdict = f"fewer than {MIN_FAMILY_SEEDS} paired seeds: descriptive only"
        else:
            verdict = f"no WER difference holds at family-wise {alpha:g}"
        lines.append(f"{condition}: {arms[arm].label} minus none: " + "; ".join(parts) + f"; {verdict}.")
    return lines


def machine_summary() -> str:
    """CPU architecture and cores, torch version, GPU."""
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}"
    )


def update_results_md(path: Path, section: str) -> None:
    """Put ``section`` between the ablation markers of ``path`` (appended, or a new file, if absent)."""
    replace_marked_section(path, SECTION, section, WRITER)


def today() -> str:
    return datetime.date.today().isoformat()
