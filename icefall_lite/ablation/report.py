"""The gradient-control ablation: its arms, the results of a finished arm (from
TensorBoard scalars and wer-summary files), the results table and the measured
findings written to RESULTS.md.

Arms (same model, data, seeds and steps):

  (a) none         no GradientFilter, no clip_grad_norm
  (b) clip         clip_grad_norm only
  (c) filter       GradientFilter only
  (d) filter-clip  both

each trained on the clean and on the corrupted training set. The RESULTS.md
section is rendered here (:func:`render_section`, from the recipe's
:class:`ReportSetup`); the plots are in :mod:`icefall_lite.ablation.plots`; the
orchestration (train.py's flags and TensorBoard tags, decode.py, resuming) is
the recipe's ``lstm_transducer_stateless/ablation.py``.
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

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.metrics import load_wer_summary
from icefall_lite.utils import replace_marked_section, section_markers, write_text_atomic
from icefall_lite.ablation.tb_reader import Series, TrainingScalarTags, after_step, last_value, read_scalars, values

TRAINING_SETS = ("clean", "corrupted")
DONE_MARKER = "ablation-done.json"
WALL_FILE = "ablation-wall.json"
SECTION_BEGIN, SECTION_END = section_markers("ablation", "lstm_transducer_stateless/ablation.py")


@dataclass(frozen=True)
class Arm:
    """One arm: which of the two gradient controls are on."""

    key: str
    name: str
    filter_on: bool
    clip_on: bool

    @property
    def dirname(self) -> str:
        return f"{self.key}-{self.name}"

    @property
    def label(self) -> str:
        parts = {(False, False): "no filter, no clipping", (False, True): "clip_grad_norm only",
                 (True, False): "GradientFilter only", (True, True): "filter + clipping"}
        return f"({self.key}) {parts[(self.filter_on, self.clip_on)]}"


ARMS: Tuple[Arm, ...] = (
    Arm("a", "none", False, False),
    Arm("b", "clip", False, True),
    Arm("c", "filter", True, False),
    Arm("d", "filter-clip", True, True),
)


# --------------------------------------------------------------------------
# Markers and wall time
# --------------------------------------------------------------------------


def write_json_atomic(path: Path, data: Dict) -> None:
    """``data`` as indented JSON, written under a temporary name and renamed."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Optional[Dict]:
    """The JSON object in ``path``, or None when the file does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None


def add_wall_time(arm_dir: Path, phase: str, seconds: float) -> Dict[str, float]:
    """Add ``seconds`` to ``phase`` in the arm's wall-time file (kept across reruns)."""
    wall = read_json(arm_dir / WALL_FILE) or {}
    wall[phase] = wall.get(phase, 0.0) + seconds
    write_json_atomic(arm_dir / WALL_FILE, wall)
    return wall


# --------------------------------------------------------------------------
# Results of one arm
# --------------------------------------------------------------------------

# The scalars of an arm, by what they hold (TrainingScalarTags field names).
SCALARS = ("loss", "grad_norm", "clip_scale", "skipped_steps", "valid_loss", "epoch")


@dataclass
class ArmResult:
    """What one finished arm measured.

    ``scalars``: ``{name in SCALARS: series}``; ``filters``: ``{(layer, stat): series}``
    of the GradientFilter statistics.
    """

    training_set: str
    arm: Arm
    wer: Dict[Tuple[str, str], float]
    scalars: Dict[str, Series]
    filters: Dict[Tuple[int, str], Series] = field(default_factory=dict)
    wall_s: Dict[str, float] = field(default_factory=dict)

    @property
    def grad_norm(self) -> Series:
        return self.scalars.get("grad_norm", [])

    @property
    def steps(self) -> int:
        return self.grad_norm[-1][0] if self.grad_norm else 0

    @property
    def skipped_steps(self) -> int:
        return int(last_value(self.scalars.get("skipped_steps", []), 0.0))

    @property
    def valid_loss(self) -> List[Tuple[int, float]]:
        """``[(epoch, validation loss per frame)]``, one per finished epoch."""
        return [(i + 1, v) for i, (_, v) in enumerate(self.scalars.get("valid_loss", []))]

    @property
    def final_train_loss(self) -> float:
        """Mean per-frame training loss over the steps of the last epoch.

        train.py writes the epoch scalar when an epoch starts and again when a
        cut-off epoch is resumed; the last epoch starts at its first point.
        """
        epochs = self.scalars.get("epoch", [])
        start = min(step for step, epoch in epochs if epoch == epochs[-1][1]) if epochs else 0
        last = values(after_step(self.scalars.get("loss", []), start))
        return sum(last) / len(last) if last else float("nan")

    @property
    def wall_total_s(self) -> float:
        return sum(self.wall_s.values())

    def filter_layers(self) -> List[int]:
        """Encoder layers with GradientFilter scalars."""
        return sorted({layer for layer, _ in self.filters})

    def filter_series(self, layer: int, stat: str) -> Series:
        return self.filters.get((layer, stat), [])


def newest_wer_summary(arm_dir: Path, method: str, test_set: str) -> Optional[Path]:
    """The newest ``<arm_dir>/<method>/wer-summary-<test_set>-*.txt``."""
    files = sorted((arm_dir / method).glob(f"wer-summary-{test_set}-*.txt"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def read_wers(arm_dir: Path, methods: Sequence[str]) -> Dict[Tuple[str, str], float]:
    """``{(method, test set): WER}`` from the arm's wer-summary files (first row: the best)."""
    wers: Dict[Tuple[str, str], float] = {}
    for method in methods:
        for test_set in TEST_SETS:
            path = newest_wer_summary(arm_dir, method, test_set)
            if path is None:
                raise FileNotFoundError(f"no {method} wer-summary for {test_set} in {arm_dir / method}; decode first")
            wers[(method, test_set)] = load_wer_summary(path)[0][1]
    return wers


def collect_arm_result(
    arm_dir: Path, training_set: str, arm: Arm, methods: Sequence[str], tags: TrainingScalarTags
) -> ArmResult:
    """Read a finished arm: WERs, the TensorBoard scalars named by ``tags`` (incl. per-layer filter
    stats), wall time."""
    scalars = read_scalars(arm_dir / "tensorboard")
    wanted = {name: scalars[getattr(tags, name)] for name in SCALARS if getattr(tags, name) in scalars}
    filters = {}
    for tag, series in scalars.items():
        layer_stat = tags.parse_filter_tag(tag)
        if layer_stat is not None:
            filters[layer_stat] = series
    return ArmResult(training_set, arm, read_wers(arm_dir, methods), wanted, filters, read_json(arm_dir / WALL_FILE) or {})


# --------------------------------------------------------------------------
# Statistics used by the findings
# --------------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``; nan when empty."""
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def grad_norm_stats(result: ArmResult) -> Dict[str, float]:
    """Median, 99th percentile and maximum of the per-step pre-clip gradient norm."""
    xs = values(result.grad_norm)
    return {"median": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs) if xs else float("nan")}


def filter_stats(result: ArmResult) -> Dict[str, float]:
    """GradientFilter activity over all layers and steps.

    ``mean_fraction``: mean fraction of sequences filtered; ``steps_filtering``:
    steps at which some layer filtered a sequence; ``max_over_median``: the
    largest per-sequence gradient RMS over the batch median seen by any layer.
    """
    fractions: Dict[int, float] = {}
    moms: List[float] = []
    all_fractions: List[float] = []
    for layer in result.filter_layers():
        for step, value in result.filter_series(layer, "fraction_filtered"):
            all_fractions.append(value)
            fractions[step] = max(fractions.get(step, 0.0), value)
        moms.extend(values(result.filter_series(layer, "max_over_median")))
    return {
        "mean_fraction": sum(all_fractions) / len(all_fractions) if all_fractions else float("nan"),
        "steps_filtering": float(sum(1 for v in fractions.values() if v > 0)),
        "steps": float(len(fractions)),
        "max_over_median": max(moms) if moms else float("nan"),
        "p99_max_over_median": percentile(moms, 99),
    }


def clip_stats(result: ArmResult) -> Dict[str, float]:
    """Fraction of steps whose gradient clip_grad_norm scaled down, and the median scale."""
    scales = values(result.scalars.get("clip_scale", []))
    if not scales:
        return {"fraction_clipped": float("nan"), "median_scale": float("nan")}
    return {"fraction_clipped": sum(1 for s in scales if s < 1.0) / len(scales), "median_scale": percentile(scales, 50)}


# --------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_table(results: Sequence[ArmResult], methods: Sequence[str]) -> str:
    """The icefall-style markdown table: one row per training set x arm."""
    wer_cols = [f"{m} {t}" for m in methods for t in TEST_SETS]
    header = (["training set", "arm"] + wer_cols
              + ["final train loss", "valid loss", "skipped steps", "steps", "wall time (min)"])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in results:
        valid = r.valid_loss[-1][1] if r.valid_loss else float("nan")
        cells = ([r.training_set, r.arm.label]
                 + [_fmt(r.wer[(m, t)]) for m in methods for t in TEST_SETS]
                 + [_fmt(r.final_train_loss, 4), _fmt(valid, 4), str(r.skipped_steps), str(r.steps),
                    _fmt(r.wall_total_s / 60, 1)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Findings: numeric comparisons only
# --------------------------------------------------------------------------


def _by_key(results: Sequence[ArmResult]) -> Dict[Tuple[str, str], ArmResult]:
    return {(r.training_set, r.arm.key): r for r in results}


def _g(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3g}"


def _arm_lines(
    by: Dict[Tuple[str, str], ArmResult], keys: Sequence[str], stats_of: Callable[[ArmResult], Dict[str, float]],
    describe: Callable[[Dict[str, float]], str], title: str,
) -> List[str]:
    """One line per arm in ``keys``: ``title``, the arm, then ``describe(stats_of(result))`` per training set."""
    lines = []
    for key in keys:
        stats = {s: stats_of(by[(s, key)]) for s in TRAINING_SETS if (s, key) in by}
        if stats:
            label = by[(next(iter(stats)), key)].arm.label
            lines.append(f"{title}, arm {label}: " + "; ".join(f"{s}: {describe(v)}" for s, v in stats.items()) + ".")
    return lines


def gradient_findings(results: Sequence[ArmResult], threshold: float) -> List[str]:
    """Lines on gradient norms, per-sequence outliers, filter and clipping activity."""
    by = _by_key(results)
    lines = _arm_lines(
        by, [a.key for a in ARMS], grad_norm_stats,
        lambda v: (f"median {_g(v['median'])}, 99th percentile {_g(v['p99'])}, max {_g(v['max'])} "
                   f"(max/median {_g(v['max'] / v['median'])})"),
        "Pre-clip global gradient norm per step",
    )
    lines += _arm_lines(
        by, [a.key for a in ARMS if a.filter_on], filter_stats,
        lambda v: (f"largest per-sequence gradient / batch median {_g(v['max_over_median'])} (99th percentile over "
                   f"steps and layers {_g(v['p99_max_over_median'])}), mean fraction of sequences filtered "
                   f"{100 * v['mean_fraction']:.3f}%, steps with a filtered sequence "
                   f"{int(v['steps_filtering'])}/{int(v['steps'])}"),
        f"GradientFilter (threshold {threshold:g})",
    )
    lines += _arm_lines(
        by, [a.key for a in ARMS if a.clip_on], clip_stats,
        lambda v: f"{100 * v['fraction_clipped']:.1f}% of steps scaled down, median scale {_g(v['median_scale'])}",
        "clip_grad_norm",
    )
    skipped = [f"{r.training_set} {r.arm.key}: {r.skipped_steps}" for r in results if r.skipped_steps]
    lines.append("Skipped (non-finite) steps: " + (", ".join(skipped) if skipped else "none in any arm") + ".")
    return lines


def filter_comparisons(results: Sequence[ArmResult], methods: Sequence[str]) -> List[Tuple[str, float, float]]:
    """``(what, WER with filter, WER without)`` for c vs a and d vs b, every set/method/test set."""
    by = _by_key(results)
    out = []
    for s in TRAINING_SETS:
        for with_f, without in (("c", "a"), ("d", "b")):
            if (s, with_f) not in by or (s, without) not in by:
                continue
            for m in methods:
                for t in TEST_SETS:
                    out.append((f"{s} set, {m}, {t}: ({with_f}) vs ({without})",
                                by[(s, with_f)].wer[(m, t)], by[(s, without)].wer[(m, t)]))
    return out


def wer_findings(results: Sequence[ArmResult], methods: Sequence[str]) -> List[str]:
    """Lines comparing WER and validation loss with and without the filter, and clean vs corrupted."""
    pairs = filter_comparisons(results, methods)
    lower = [p for p in pairs if p[1] < p[2]]
    higher = [p for p in pairs if p[1] > p[2]]
    lines = [f"WER with vs without the filter ((c) vs (a), (d) vs (b); {len(pairs)} pairs): lower in {len(lower)}, "
             f"higher in {len(higher)}, equal in {len(pairs) - len(lower) - len(higher)}."]
    if pairs:
        deltas = [w - wo for _, w, wo in pairs]
        lines.append(f"WER difference (filter minus no filter, absolute %): mean {statistics.mean(deltas):+.2f}, "
                     f"range {min(deltas):+.2f} to {max(deltas):+.2f}.")
    not_helped = [p for p in pairs if p[1] >= p[2]]
    if not_helped:
        lines.append("Where the filter did not lower WER: "
                     + "; ".join(f"{what} {w:.2f} vs {wo:.2f}" for what, w, wo in not_helped) + ".")
    by = _by_key(results)
    for s in TRAINING_SETS:
        for with_f, without in (("c", "a"), ("d", "b")):
            if (s, with_f) in by and (s, without) in by and by[(s, with_f)].valid_loss and by[(s, without)].valid_loss:
                v1, v0 = by[(s, with_f)].valid_loss[-1][1], by[(s, without)].valid_loss[-1][1]
                lines.append(f"Final validation loss, {s} set: ({with_f}) {v1:.4f} vs ({without}) {v0:.4f} ({v1 - v0:+.4f}).")
    if ("clean", "a") in by and ("corrupted", "a") in by:
        cells = ", ".join(f"{m} {t} {by[('corrupted', 'a')].wer[(m, t)]:.2f} vs {by[('clean', 'a')].wer[(m, t)]:.2f}"
                          for m in methods for t in TEST_SETS)
        lines.append(f"Effect of the corruption on arm (a), corrupted vs clean: {cells}.")
    return lines


def findings(results: Sequence[ArmResult], methods: Sequence[str], threshold: float, seed: int) -> List[str]:
    """All measured statements, plus the limits of the measurement."""
    return (gradient_findings(results, threshold) + wer_findings(results, methods)
            + [f"Each arm was trained once (seed {seed}); the spread between seeds was not measured, so differences "
               "of the size seen between arms may be within run-to-run variation."])


# --------------------------------------------------------------------------
# RESULTS.md
# --------------------------------------------------------------------------


@dataclass
class ReportSetup:
    """What the recipe says about its run, worded: the command, the setup paragraph, every command run,
    the decoding methods, the GradientFilter threshold and the seed."""

    command: str
    setup: str
    commands: List[str]
    methods: Sequence[str]
    threshold: float
    seed: int


def machine_summary() -> str:
    """CPU architecture and cores, torch version, GPU."""
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}")


def steps_note(results: Sequence[ArmResult]) -> str:
    """Whether every arm ran the same number of training steps."""
    steps = sorted({r.steps for r in results})
    if len(steps) == 1:
        return f"Every arm ran {steps[0]} training steps."
    return "The arms ran different numbers of steps: " + ", ".join(
        f"{r.training_set} {r.arm.key} {r.steps}" for r in results) + "."


def render_section(results: Sequence[ArmResult], plots: Dict[str, Path], setup: ReportSetup) -> str:
    """The ablation section of RESULTS.md: setup, table, findings, plots, commands."""
    plot_lines = [f"![{kind}]({p.name})" for kind, p in plots.items()]
    lines = [
        "## Ablation: GradientFilter and clip_grad_norm",
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
        "WER (%) on test-clean / test-other. Final train loss: mean per-frame training loss over the last epoch's "
        "steps; valid loss: per-frame loss on dev-clean + dev-other after the last epoch; wall time: training plus "
        "decoding of the arm.",
        "",
        format_table(results, setup.methods),
        "",
        "### What was measured",
        "",
        *[f"- {line}" for line in findings(results, setup.methods, setup.threshold, setup.seed)],
        "",
        "### Plots",
        "",
        "Per-step pre-clip gradient norm per arm (log scale); GradientFilter statistics per layer (fraction of "
        "sequences filtered; largest per-sequence gradient RMS over the batch median, the quantity compared with the "
        "threshold; arms with the filter only); validation loss per epoch; training loss.",
        "",
        *plot_lines,
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
    replace_marked_section(path, "ablation", section, "lstm_transducer_stateless/ablation.py")
