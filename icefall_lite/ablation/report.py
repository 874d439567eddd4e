"""The gradient-control ablation's results: what one finished run measured
(from its TensorBoard scalars, checkpoint and wer-summary files), the spread
over seeds, the table, where per-sequence gradient outliers arise, the
findings and the RESULTS.md section.

A difference between two arms is called real only when both have at least 3
seeds and the ranges of their seeds do not overlap (every seed of one arm is
better than every seed of the other). With 3 seeds each and no true
difference, this happens by chance in 2 of the 20 equally likely orderings of
the six values, 10% of comparisons; the report says so.

The recipe's ``lstm_transducer_stateless/ablation.py`` runs the arms
(:mod:`icefall_lite.ablation.arms`) and hands the results here; the plots are
in :mod:`icefall_lite.ablation.plots`.
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
from icefall_lite.ablation.tb_reader import Series, read_scalars, values
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.train.tb_tags import TrainingScalarTags
from icefall_lite.utils import replace_marked_section, write_text_atomic

SECTION = "ablation"
WRITER = "lstm_transducer_stateless/ablation.py"
DONE_MARKER = "ablation-done.json"
WALL_FILE = "ablation-wall.json"
# The losses below are of the transducer objective after warm-up, 0.5 x simple +
# pruned per frame, whatever weights the warm-up ramp gave them at the step
# (train/loss changes its weights at --model-warm-step and twice that).
OBJECTIVE_SIMPLE_SCALE = 0.5
# Loss spikes: a step whose objective is more than SPIKE_FACTOR times the
# median of the SPIKE_WINDOW steps before it (from step SPIKE_WINDOW on).
SPIKE_FACTOR = 2.0
SPIKE_WINDOW = 50
# Divergence: training loss (mean of the last DIVERGE_WINDOW steps) more than
# DIVERGE_FACTOR times its lowest such mean earlier in the run, or a skipped
# (non-finite) step.
DIVERGE_FACTOR = 1.5
DIVERGE_WINDOW = 20
# icefall's ablation (lstm_transducer_stateless3, 960 h, 40 epochs, epoch 40 avg 15; greedy search):
ICEFALL_GREEDY = {"no filter": (3.79, 9.71), "GradientFilter 25": (3.66, 9.51)}


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

    ``scalars``: ``{TrainingScalarTags field: series}``; ``filters``:
    ``{(layer, stat): series}`` of the per-layer GradientFilter statistics
    (the observing filter's too).
    """

    key: RunKey
    wer: Dict[Tuple[str, str], float]
    scalars: Dict[str, Series]
    filters: Dict[Tuple[int, str], Series] = field(default_factory=dict)
    wall_s: Dict[str, float] = field(default_factory=dict)

    def series(self, name: str) -> Series:
        return self.scalars.get(name, [])

    @property
    def steps(self) -> int:
        grad_norm = self.series("grad_norm")
        return grad_norm[-1][0] if grad_norm else 0

    def objective(self) -> Series:
        """``[(step, 0.5 x simple + pruned loss per frame)]``: the training loss after warm-up, comparable
        over the whole run."""
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


def collect_run(run_dir: Path, key: RunKey, methods: Sequence[str], tags: TrainingScalarTags) -> RunResult:
    """Read a finished run: WERs, the scalars named by ``tags`` (with the per-layer filter stats), wall time."""
    scalars = read_scalars(run_dir / "tensorboard")
    wanted = {
        name: scalars[getattr(tags, name)]
        for name in ("simple_loss", "pruned_loss", "grad_norm", "clip_scale", "skipped_steps", "valid_loss")
        if getattr(tags, name) in scalars
    }
    filters = {}
    for tag, series in scalars.items():
        layer_stat = tags.parse_filter_tag(tag)
        if layer_stat is not None:
            filters[layer_stat] = series
    return RunResult(key, read_wers(run_dir, methods), wanted, filters, read_json(run_dir / WALL_FILE) or {})


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``; nan when empty."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def loss_spikes(loss: Series, factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW) -> int:
    """Steps whose loss is more than ``factor`` x the median of the ``window`` losses before it
    (a non-finite loss counts as a spike)."""
    xs = [v for _, v in loss]
    count = 0
    for i in range(window, len(xs)):
        before = [x for x in xs[i - window : i] if math.isfinite(x)]
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


def steps_filtered(result: RunResult) -> float:
    """Fraction of steps at which some layer's filter capped a sequence."""
    by_step: Dict[int, float] = {}
    for layer in result.layers():
        for step, v in result.filter_series(layer, "fraction_filtered"):
            by_step[step] = max(by_step.get(step, 0.0), v)
    return sum(1 for v in by_step.values() if v > 0) / len(by_step) if by_step else float("nan")


def steps_clipped(result: RunResult) -> float:
    """Fraction of steps whose gradient the clipping (norm, value or AGC) changed: clip scale (post- over
    pre-clip norm) below 1 (always 1 without such clipping)."""
    scales = values(result.series("clip_scale"))
    return sum(1 for x in scales if x < 1.0) / len(scales) if scales else float("nan")


def largest_outlier(result: RunResult) -> float:
    """The largest per-sequence gradient RMS over the batch median, any layer, any step."""
    xs = [v for layer in result.layers() for v in values(result.filter_series(layer, "max_over_median"))]
    return max(xs) if xs else float("nan")


def final_train_loss(result: RunResult) -> float:
    """Mean objective per frame over the last tenth of the steps (at least 10)."""
    xs = values(result.objective())
    tail = xs[-max(10, len(xs) // 10) :]
    return sum(tail) / len(tail) if tail else float("nan")


def skipped_steps(result: RunResult) -> int:
    s = result.series("skipped_steps")
    return int(s[-1][1]) if s else 0


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


def metrics(methods: Sequence[str]) -> List[Metric]:
    """The table's columns: WERs, losses, spikes, divergence, filtering, outliers, wall time."""
    out = [
        Metric(f"wer/{m}/{t}", f"{m.replace('_search', '')} {t}", (lambda r, m=m, t=t: r.wer[(m, t)]), 2)
        for m in methods
        for t in TEST_SETS
    ]
    out += [
        Metric("train_loss", "final train loss", final_train_loss, 3),
        Metric(
            "valid_loss",
            "valid loss",
            lambda r: r.series("valid_loss")[-1][1] if r.series("valid_loss") else float("nan"),
            3,
        ),
        Metric("spikes", "loss spikes", lambda r: float(loss_spikes(r.objective())), 1),
        Metric("skipped", "skipped steps", lambda r: float(skipped_steps(r)), 1),
        Metric("diverged", "diverged runs", lambda r: float(diverged(r.objective(), skipped_steps(r))), 0, True),
        Metric("filtered", "% steps filtered", lambda r: 100 * steps_filtered(r), 1),
        Metric("clipped", "% steps clipped", lambda r: 100 * steps_clipped(r), 1),
        Metric("outlier", "max seq grad / median", largest_outlier, 1),
        Metric("wall", "wall min", lambda r: sum(r.wall_s.values()) / 60, 1),
    ]
    return out


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


MIN_SEEDS_FOR_REAL = 3


def separated(a: Spread, b: Spread) -> bool:
    """Whether the seed ranges of ``a`` and ``b`` do not overlap, with at least MIN_SEEDS_FOR_REAL seeds each."""
    return a.n >= MIN_SEEDS_FOR_REAL and b.n >= MIN_SEEDS_FOR_REAL and (a.high < b.low or b.high < a.low)


Group = Dict[Tuple[str, str], List[RunResult]]


def group_runs(results: Sequence[RunResult]) -> Group:
    """``{(condition, arm): [runs, one per seed]}`` in the order of ``results``."""
    groups: Group = {}
    for r in results:
        groups.setdefault((r.key.condition, r.key.arm), []).append(r)
    return groups


def spreads(runs: Sequence[RunResult], ms: Sequence[Metric]) -> Dict[str, Spread]:
    return {m.name: Spread.of([m.of(r) for r in runs]) for m in ms}


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
    """Per layer, top layer first, over all steps of ``runs``: median, 99th percentile and maximum of
    max/median, and the percentage of steps above each threshold."""
    layers = sorted({layer for r in runs for layer in r.layers()}, reverse=True)
    rows = []
    for layer in layers:
        xs = [v for r in runs for v in values(r.filter_series(layer, "max_over_median"))]
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


def first_outlier_layer(rows: Sequence[Dict[str, float]], threshold: float) -> Optional[int]:
    """The highest layer (gradients flow down from the top) with a step above ``threshold``."""
    for row in rows:  # top layer first
        if row["max"] > threshold:
            return int(row["layer"])
    return None


# --------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------


def comparisons(
    results: Sequence[RunResult], arms: Dict[str, Arm], methods: Sequence[str], baseline: str = "none"
) -> List[str]:
    """Each arm against ``baseline`` in each condition: the difference of the means of every WER and the
    validation loss, and whether the seed ranges are apart."""
    ms = [m for m in metrics(methods) if m.name.startswith("wer/") or m.name == "valid_loss"]
    groups = group_runs(results)
    lines = []
    for (condition, arm), runs in groups.items():
        if arm == baseline or (condition, baseline) not in groups:
            continue
        mine, base = spreads(runs, ms), spreads(groups[(condition, baseline)], ms)
        parts, real = [], []
        for m in ms:
            d = mine[m.name].mean - base[m.name].mean
            parts.append(f"{m.header} {d:+.{m.digits}f}")
            if separated(mine[m.name], base[m.name]):
                real.append(f"{m.header} ({'better' if d < 0 else 'worse'})")
        verdict = ("beyond the seed spread: " + ", ".join(real)) if real else "no difference beyond the seed spread"
        lines.append(f"{condition}: {arms[arm].label} vs {arms[baseline].label}: " + "; ".join(parts) + f"; {verdict}.")
    return lines


# --------------------------------------------------------------------------
# RESULTS.md
# --------------------------------------------------------------------------


@dataclass
class ReportSetup:
    """What the recipe says about its run: the command, the setup paragraph (conditions, budget, thresholds and
    why), every command run, the decoding methods, the filter's threshold sweep."""

    command: str
    setup: str
    commands: List[str]
    methods: Sequence[str]
    sweep: Sequence[float]


def machine_summary() -> str:
    """CPU architecture and cores, torch version, GPU."""
    return (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}"
    )


def render_section(
    results: Sequence[RunResult],
    arms: Dict[str, Arm],
    plots: Dict[str, Path],
    setup: ReportSetup,
    observing_arm: str = "none",
) -> str:
    """The ablation section of RESULTS.md."""
    lines = [
        "## Ablation: GradientFilter, clip_grad_norm and the other gradient controls",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: {machine_summary()}.",
        "",
        "Command (from `egs/librispeech/ASR`):",
        "",
        "```bash",
        setup.command,
        "```",
        "",
        setup.setup,
        "",
        "Each cell: mean ± standard deviation over the seeds ((n=k): only k seeds had a finite value). WER (%) with "
        f"{', '.join(m.replace('_', ' ') for m in setup.methods)} on the weights at the end of the budget; losses are "
        f"of the objective after warm-up ({OBJECTIVE_SIMPLE_SCALE:g} x simple + pruned, per frame); final train "
        "loss: its mean over the last tenth of the steps (at least 10); valid "
        "loss: dev-clean + dev-other at the end; loss spikes: steps whose loss is more than "
        f"{SPIKE_FACTOR:g}x the median of the {SPIKE_WINDOW} steps before; diverged runs: runs with a skipped "
        f"(non-finite) step or whose last {DIVERGE_WINDOW}-step mean loss is over {DIVERGE_FACTOR:g}x its lowest; "
        "% steps filtered: steps at which some layer's GradientFilter capped a sequence; % steps clipped: steps "
        "whose gradient norm the clipping (by norm, by value or AGC) lowered; max seq grad / median: "
        "the largest per-sequence gradient RMS over the batch median seen by any layer (before that layer's "
        "filter).",
        "",
        format_table(results, arms, setup.methods),
        "",
    ]
    for condition in dict.fromkeys(r.key.condition for r in results):
        observed = [r for r in results if r.key.condition == condition and r.key.arm == observing_arm]
        if not observed:
            continue
        thresholds = sorted(set(setup.sweep))
        rows = outlier_rows(observed, thresholds)
        top = first_outlier_layer(rows, min(thresholds))
        lines += [
            f"### Where the outliers arise ({condition}, arm `{observing_arm}`: the filter observes only)",
            "",
            f"Per encoder layer (top layer first; gradients flow down), over every step of its {len(observed)} "
            "seed(s): the largest per-sequence gradient RMS over the batch median, and how often it was above "
            "each threshold of the sweep.",
            "",
            format_outlier_table(rows, thresholds),
            "",
            (
                f"The highest layer with a step above {min(thresholds):g} is layer {top}."
                if top is not None
                else f"No layer had a step above {min(thresholds):g}."
            ),
            "",
        ]
    lines += [
        "### Differences between arms",
        "",
        "Each arm's mean minus the mean of the arm without any control, in the same condition (negative: lower "
        f"WER or loss). A difference is called real only when both arms have at least {MIN_SEEDS_FOR_REAL} seeds "
        "and their seed ranges do not overlap; with 3 seeds each and no true difference that happens by chance in "
        "10% of comparisons (2 of the 20 equally likely orderings), so one such finding among many is weak "
        "evidence.",
        "",
        *[f"- {line}" for line in comparisons(results, arms, setup.methods)],
        "",
        "For comparison, icefall's own ablation of the filter (lstm_transducer_stateless3, 960 h of LibriSpeech, "
        "40 epochs on 4 GPUs, epoch 40 avg 15, greedy search, test-clean / test-other; not measured here): "
        + ", ".join(f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in ICEFALL_GREEDY.items())
        + ".",
        "",
        "### Plots",
        "",
        *[f"![{kind}]({p.name})" for kind, p in plots.items()],
        "",
        "<details><summary>Every command the ablation ran (from egs/librispeech/ASR)</summary>",
        "",
        "```bash",
        *setup.commands,
        "```",
        "",
        "</details>",
    ]
    return "\n".join(lines) + "\n"


def update_results_md(path: Path, section: str) -> None:
    """Put ``section`` between the ablation markers of ``path`` (appended, or a new file, if absent)."""
    replace_marked_section(path, SECTION, section, WRITER)
