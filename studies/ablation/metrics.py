"""The numbers of the ablation's table, per run and over seeds: the WERs, the losses, loss spikes after
warm-up, divergence, where per-sequence gradient outliers arise (per layer), how often the filter and the
clipping acted, the optimizer's second-moment jumps, wall time; the mean and spread over seeds; the table.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.optimizer_state import EVENT_JUMP
from studies.ablation.arms import STUDY, Arm
from studies.ablation.markdown import markdown_table
from studies.ablation.runs import ERROR_CLIP, RECURRENT_CLIP, RunResult
from studies.stats.paired import mid_ranks
from studies.tb_reader import Series, moving_average, values

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
    before: List[float] = []  # the finite losses of xs[i - window : i], sorted (a sliding median, not a sort per step)
    for i, x in enumerate(xs):
        if i >= SPIKE_MIN_WINDOW and (not math.isfinite(x) or (before and x > factor * _sorted_median(before))):
            count += 1
        if math.isfinite(x):
            bisect.insort(before, x)
        if i >= window and math.isfinite(xs[i - window]):
            del before[bisect.bisect_left(before, xs[i - window])]
    return count


def _sorted_median(ordered: Sequence[float]) -> float:
    """The median of an already sorted sequence, as :func:`statistics.median` computes it."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


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
    """Fraction of steps at which some layer's filter met a sequence over its cutoff (the soft filter rescales
    every gradient at every step; this counts the steps it capped one far above the median)."""
    by_step: Dict[int, float] = {}
    for layer in result.layers():
        for step, v in result.filter_series(layer, "fraction_filtered"):
            by_step[step] = max(by_step.get(step, 0.0), v)
    return _fraction([v > 0 for v in by_step.values()])


def steps_clipped(result: RunResult) -> float:
    """Fraction of steps whose gradient the clipping (norm, relative norm, value or AGC) changed: clip scale
    (post- over pre-clip norm) below 1 (always 1 without such clipping)."""
    return _fraction([x < 1.0 for x in values(result.series("clip_scale"))])


# Controls that act inside backward, not through the clip scale: the filter in each layer's backward, the
# recurrent cap on a frame row's derivative, the error clip on one tensor's gradient.
IN_BACKWARD = ("grad_filter_threshold", "recurrent_grad_clip", "error_clip")


def clips(arm: Arm) -> bool:
    """Whether the arm clips the gradient after backward (its effect shows in the clip scale)."""
    return any(control not in IN_BACKWARD for control, _ in arm.settings)


def decoded(result: RunResult) -> Dict[int, Dict[Tuple[str, str], float]]:
    """``{step: {(method, test set): WER}}``: every decoding point of the run (a run decoded at its end only:
    that one)."""
    return result.wer_at or {result.steps: result.wer}


def steps_acting(result: RunResult, arm: Arm) -> float:
    """Fraction of steps at which the arm's control changed a gradient: some sequence was over the filter's
    cutoff (arms with the filter on), the recurrent cap clipped a frame row, the error clip clipped an element,
    or the clipping after backward lowered the norm (every other control, ScaledAdam's rule among them: with
    --scaled-adam-clipping-scale the optimizer is Eve and the rule acts through the clip scale). nan for an
    arm without a control, and for an error clip run from before the error clip was logged."""
    if arm.filter_on:
        return steps_filtered(result)
    for flag, series in (("recurrent_grad_clip", RECURRENT_CLIP), ("error_clip", ERROR_CLIP)):
        if arm.value(flag) > 0:
            return _fraction([x > 0.0 for x in values(result.series(series))])
    if not arm.settings:
        return float("nan")
    return steps_clipped(result)


# Controls whose statistic is a ratio of measured norms (post- over pre-clip), which one clamped element can
# leave at 1: a scale of 1 does not show that they changed nothing.
MEASURED_NOT_APPLIED = ("clip_grad_value", "agc_clipping")


def counts_what_it_applies(arm: Arm) -> bool:
    """Whether :func:`steps_acting` at 0 shows that the arm changed no gradient: not for the soft filter (it
    scales every sequence at every step; it counts the ones over the cutoff) nor for clipping by value or AGC
    (:data:`MEASURED_NOT_APPLIED`); yes for the hard mask, the recurrent cap, the error clip and the rules that
    scale the whole gradient (their logged scale is the factor applied)."""
    return not (arm.filter_on and arm.mode == "soft") and not any(arm.value(c) > 0 for c in MEASURED_NOT_APPLIED)


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


@dataclass
class LayerOutliers:
    """One layer's per-sequence gradient ratios (largest over the batch median) after warm-up."""

    layer: int
    median: float
    p99: float
    largest: float
    largest_step: int
    percent_over: float
    first_over: Optional[int]  # the first step after warm-up over the threshold; None: never


def layer_outliers(run: RunResult, threshold: float) -> List[LayerOutliers]:
    """Per layer, top layer first (gradients flow down), over the steps from ``run.warm_end`` on."""
    rows = []
    for layer in sorted(run.layers(), reverse=True):
        series = [
            (s, v) for s, v in run.filter_series(layer, "max_over_median") if s >= run.warm_end and math.isfinite(v)
        ]
        if not series:
            continue
        values = [v for _, v in series]
        largest_step, largest = max(series, key=lambda sv: sv[1])
        over = [s for s, v in series if v > threshold]
        rows.append(
            LayerOutliers(
                layer,
                percentile(values, 50),
                percentile(values, 99),
                largest,
                largest_step,
                100 * len(over) / len(series),
                over[0] if over else None,
            )
        )
    return rows


def first_and_largest(layers: Sequence[LayerOutliers]) -> Tuple[str, str]:
    """Two cells from one run's :func:`layer_outliers`: the layer first over the threshold with its step
    (``layer (step)``; the lowest layer where several go over at one step; ``never``), and the largest ratio
    with its layer and step (``ratio: layer (step)``; ``-`` without layers)."""
    firsts = [(r.first_over, r.layer) for r in layers if r.first_over is not None]
    first = "never" if not firsts else "{1} ({0})".format(*min(firsts))
    if not layers:
        return first, "-"
    top = max(layers, key=lambda r: r.largest)
    return first, f"{top.largest:.1f}: {top.layer} ({top.largest_step})"


def plateau_exit(result: RunResult, loss: float = STUDY.plateau_loss, window: int = STUDY.plateau_window) -> float:
    """The step of leaving the loss plateau: the first step at which the trailing mean over ``window`` steps
    of the objective (0.5 x simple + pruned per frame) is below ``loss``; nan when it never is."""
    for step, value in moving_average(result.objective(), window):
        if value < loss:
            return float(step)
    return float("nan")


def median_clip_scale(result: RunResult) -> float:
    """The median over steps of the clip scale (post- over pre-clip norm; 1 without clipping)."""
    xs = values(result.series("clip_scale"))
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
    heavy: bool = False  # heavy-tailed over seeds (one seed can dominate a mean): shown as median [min, max]

    def cell(self, runs: Sequence[RunResult]) -> str:
        xs = [self.of(r) for r in runs]
        if self.count:
            return f"{int(sum(xs))}/{len(xs)}"
        if self.heavy:
            return range_cell(xs, self.digits)
        return spread_cell(xs, self.digits)


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
        Metric("plateau", f"plateau exit step (loss < {STUDY.plateau_loss:g})", plateau_exit, 0),
        Metric("spikes", "loss spikes", lambda r: float(loss_spikes(r.objective(), r.warm_end)), 1),
        Metric("diverged", "diverged runs", lambda r: float(diverged(r.objective(), skipped_steps(r))), 0, True),
        Metric("outliers", f"% steps > {OUTLIER_RATIO:g}x", lambda r: 100 * outlier_steps(r), 1),
        Metric("outlier", "max seq grad / median", largest_outlier, 1, heavy=True),
        Metric("filtered", "% steps filtered", lambda r: 100 * steps_filtered(r), 1),
        Metric("clipped", "% steps clipped", lambda r: 100 * steps_clipped(r), 1),
        Metric("jump", "max exp_avg_sq jump", largest_jump, 2, heavy=True),
        Metric("jumps", f"% steps jump > {EVENT_JUMP:g}", lambda r: 100 * jump_steps(r), 1),
        Metric("recovery", "recovery steps", recovery_steps, 0, heavy=True),
        Metric("wall", "wall min", lambda r: r.wall_total_s / 60, 1),
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


def spread_cell(xs: Sequence[float], digits: int) -> str:
    """Mean ± sd of the finite ``xs``, with (n=k) when only k of them are finite."""
    spread = Spread.of(xs)
    return spread.cell(digits) + (f" (n={spread.n})" if 0 < spread.n < len(xs) else "")


def range_cell(xs: Sequence[float], digits: int) -> str:
    """Median [smallest, largest] of the finite ``xs``, with (n=k) when only k of them are finite."""
    finite = sorted(x for x in xs if math.isfinite(x))
    if not finite:
        return "-"
    cell = _num(statistics.median(finite), digits)
    if len(finite) > 1:
        cell += f" [{_num(finite[0], digits)}, {_num(finite[-1], digits)}]"
    return cell + (f" (n={len(finite)})" if len(finite) < len(xs) else "")


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


def seed_ranges(runs: Sequence[RunResult]) -> str:
    """The seeds of ``runs``, consecutive ones as ranges: ``42-46, 50``."""
    seeds = sorted(r.key.seed for r in runs)
    parts: List[str] = []
    i = 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts.append(str(seeds[i]) if i == j else f"{seeds[i]}-{seeds[j]}")
        i = j + 1
    return ", ".join(parts)


def format_table(results: Sequence[RunResult], arms: Dict[str, Arm], methods: Sequence[str]) -> str:
    """One row per condition x arm: mean ± standard deviation over the seeds of every metric."""
    ms = metrics(methods)
    header = ["condition", "arm", "seeds", "steps"] + [m.header for m in ms]
    rows = []
    for (condition, arm), runs in group_runs(results).items():
        steps = sorted({r.steps for r in runs})
        rows.append(
            [condition, arms[arm].label, seed_ranges(runs), "/".join(str(x) for x in steps)]
            + [m.cell(runs) for m in ms]
        )
    return markdown_table(header, rows)


def format_wer_curves(results: Sequence[RunResult], arms: Dict[str, Arm], methods: Sequence[str]) -> str:
    """One row per condition x arm: the WERs (mean ± sd over seeds) at every step the runs were decoded at
    (a third, two thirds and the whole budget; runs decoded at the end only have that column)."""
    points = sorted({step for r in results for step in decoded(r)})
    keys = [(m, t) for m in methods for t in TEST_SETS]
    header = ["condition", "arm", "seeds"] + [
        f"{m.replace('_search', '')} {t} at {step}" for step in points for m, t in keys
    ]
    rows = []
    for (condition, arm), runs in group_runs(results).items():
        cells = [condition, arms[arm].label, str(len(runs))]
        for step in points:
            for k in keys:
                xs = [decoded(r).get(step, {}).get(k, float("nan")) for r in runs]
                cells.append(spread_cell(xs, 2))
        rows.append(cells)
    return markdown_table(header, rows)


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
    cells = []
    for row in rows:
        line = [str(int(row["layer"])), _num(row["median"], 2), _num(row["p99"], 1), _num(row["max"], 1)]
        cells.append(line + [f"{row[f'over {t:g}']:.2f}" for t in thresholds])
    return markdown_table(header, cells, "r" * len(header))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation of paired values (finite pairs; ties at mid-ranks): the Pearson correlation
    of their ranks (:func:`within_group_spearman` of one group). nan with fewer than 3 pairs or a constant side."""
    rho, pairs = within_group_spearman([(xs, ys)])
    return rho if pairs >= 3 else float("nan")


def within_group_spearman(groups: Sequence[Tuple[Sequence[float], Sequence[float]]]) -> Tuple[float, int]:
    """Spearman's correlation within groups (the arms): each group's finite pairs ranked within the group (mid
    ranks) and centred on the group's mean rank, then the Pearson correlation of all groups' centred ranks
    pooled, so differences between groups do not count. ``(correlation, pairs used)``; a group of fewer than 2
    pairs adds nothing; nan when nothing varies."""
    cx: List[float] = []
    cy: List[float] = []
    for xs, ys in groups:
        pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
        if len(pairs) < 2:
            continue
        rx = mid_ranks([x for x, _ in pairs])
        ry = mid_ranks([y for _, y in pairs])
        mx, my = statistics.mean(rx), statistics.mean(ry)
        cx += [a - mx for a in rx]
        cy += [b - my for b in ry]
    sxy = sum(a * b for a, b in zip(cx, cy))
    sxx = sum(a * a for a in cx)
    syy = sum(b * b for b in cy)
    return (sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")), len(cx)
