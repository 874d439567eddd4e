"""The ablation section of RESULTS.md: setup, the table per arm, where the
outliers arise, the paired differences with their intervals, the replayed
events, the answer in plain words, icefall's own table beside it, the plots
and every command."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from icefall_lite.train.optimizer_state import EVENT_JUMP, RECOVERED_RATIO
from studies.ablation.arms import Arm, Condition, Thresholds
from studies.ablation.compare import FAMILY_ALPHA, MIN_FAMILY_SEEDS, findings, format_comparisons, paired_comparisons
from studies.ablation.metrics import (
    DIVERGE_FACTOR,
    DIVERGE_WINDOW,
    OUTLIER_RATIO,
    SPIKE_FACTOR,
    SPIKE_WINDOW,
    format_outlier_table,
    format_table,
    outlier_rows,
    outlier_steps,
)
from studies.ablation.replay import (
    ReplayResult,
    format_replay_table,
    median_state_damage,
    replay_differences,
    reproduces,
)
from studies.ablation.runs import OBJECTIVE_SIMPLE_SCALE, RunResult
from studies.runner import Section

SECTION = Section("ablation", "lstm_transducer_stateless/ablation.py")
# icefall's own ablation of the filter, with its source (a data file: not measured here).
ICEFALL_PUBLISHED = Path(__file__).with_name("icefall_published.json")


def icefall_greedy() -> Dict[str, Tuple[float, float]]:
    """``{arm: (test-clean, test-other)}``: icefall's published greedy-search WERs without and with the filter."""
    data = json.loads(ICEFALL_PUBLISHED.read_text(encoding="utf-8"))
    return {arm: (wers["test-clean"], wers["test-other"]) for arm, wers in data["greedy_search"].items()}


@dataclass
class ReportSetup:
    """What the study says about its runs: the command, the conditions, thresholds, every command run, the
    decoding methods, the replays' window, model flags added to every run, the date and the machine."""

    command: str
    conditions: Dict[str, Condition]
    thresholds: Thresholds
    commands: List[str]
    methods: Sequence[str]
    replay_steps: int
    model_args: Sequence[str]
    date: str
    machine: str


def setup_text(setup: ReportSetup, results: Sequence[RunResult]) -> List[str]:
    t = setup.thresholds
    lines = ["Conditions (each run trains from scratch; a seed fixes initialisation and batch order in every arm):", ""]
    for name in dict.fromkeys(r.key.condition for r in results):
        c = setup.conditions.get(name)
        if c is not None:
            lines.append(
                f"- **{name}**: {c.description}; {c.steps} steps (`--max-batches`) at `--max-duration "
                f"{c.max_duration:g}`; the loss weights reach full weight at step {c.warm_end}."
            )
    lines += [
        "",
        "Arms: `none` has no control; its GradientFilter only observes (`--grad-filter-threshold inf`: per-layer "
        "statistics, gradients untouched), as in every arm without the filter. Thresholds: GradientFilter "
        f"{t.grad_filter_threshold:g} (the recipe's and icefall's stateless3; sweep "
        f"{', '.join(f'{x:g}' for x in t.filter_sweep)}); clip_grad_norm {t.clip_grad_norm:g} (the recipe's); "
        f"relative clipping at {t.clip_grad_norm_relative:g}x the running median gradient norm (as ScaledAdam's "
        f"clipping_scale); AGC lambda {t.agc_clipping:g}; clip by value {t.clip_grad_value:g}; error clip "
        f"{t.error_clip:g}. Decoding: {', '.join(setup.methods)} with the weights at "
        "the end of the budget (`--avg 1`)."
        + (f" Model flags added to every run: `{' '.join(setup.model_args)}`." if setup.model_args else ""),
    ]
    return lines


def column_notes() -> str:
    return (
        "Each cell: mean ± standard deviation over the seeds ((n=k): only k seeds had a finite value). WER (%) on "
        "the weights at the end of the budget. Losses are of the objective after warm-up "
        f"({OBJECTIVE_SIMPLE_SCALE:g} x simple + pruned, per frame); final train loss: the mean over the last "
        "tenth of the steps; valid loss: dev-clean + dev-other at the end. Loss spikes: steps after warm-up whose "
        f"loss is over {SPIKE_FACTOR:g}x the median of the (up to) {SPIKE_WINDOW} steps after warm-up before it. "
        f"Diverged: a skipped (non-finite) step, or a last-{DIVERGE_WINDOW}-step mean over {DIVERGE_FACTOR:g}x its "
        f"lowest. % steps > {OUTLIER_RATIO:g}x: steps after warm-up at which some layer's largest per-sequence "
        "gradient RMS was over that multiple of the batch median (measured before that layer's filter). % steps "
        "filtered: some layer's filter met a sequence above its cutoff (the filter is soft: it scales every "
        "sequence's gradient by c / (c + n_b), about 0.96 at the median for threshold 25, and caps those far above "
        "c); % steps clipped: the clipping lowered the gradient norm. Max exp_avg_sq jump: after warm-up, the "
        "largest ratio of a parameter tensor's Adam second moment "
        f"(sum of exp_avg_sq) after a step to before it; % steps jump > {EVENT_JUMP:g}: how often a step inflated "
        f"some tensor's second moment that much; recovery steps: the median number of steps such a tensor took to "
        f"come back to {RECOVERED_RATIO:g}x its value before the jump (its updates are smaller meanwhile; "
        "events not recovered by the end of the run are not counted)."
    )


def replay_section(
    replays: Sequence[ReplayResult], setup: ReportSetup, originals: Dict[Tuple[str, int], RunResult]
) -> List[str]:
    if not replays:
        return []
    threshold = setup.thresholds.grad_filter_threshold
    diffs = replay_differences(replays, setup.methods)
    same = sum(r.identical_batches for r in replays)
    reproduced = sum(
        reproduces(r, originals[(r.key.condition, r.key.seed)])
        for r in replays
        if (r.key.condition, r.key.seed) in originals
    )
    lines = [
        "### Replayed outlier events",
        "",
        f"Each replay resumes a `none` run at the step just before an outlier event (a step after warm-up with a "
        f"layer over {threshold:g}x the batch median; the largest event per checkpoint interval, the "
        "largest intervals per seed; the run's nearest earlier checkpoint trained on without control up to that "
        f"step) and trains {setup.replay_steps} steps twice on the same batches, the first being the event: without "
        "the filter (which reproduces the original run) and with GradientFilter "
        f"{threshold:g}; then both are decoded. Same batches: the batch digests (a hash of the "
        f"cut ids) agree at every step ({same} of {len(replays)} replays); reproduces run: the unfiltered "
        f"branch's losses equal the original run's at every step both have ({reproduced} of {len(replays)}; "
        "a window may run past the budget). exp_avg_sq none / filter at "
        "end: the largest ratio over parameter tensors of the unfiltered branch's Adam second moment to the "
        "filtered branch's after the window (above 1: the outlier left a larger second moment, so smaller "
        f"updates; median over replays {median_state_damage(replays):.2f}).",
        "",
        format_replay_table(replays, setup.methods, originals),
        "",
        "Filter minus none over the replays (paired by event; events of one seed share a run, so the interval "
        "is optimistic about their independence):",
        "",
        "| measure | mean | 95% interval | p | events |",
        "|---|---|---|---|---|",
    ]
    for name, d in diffs.items():
        mean = "-" if math.isnan(d.mean) else f"{d.mean:+.4f}" if name == "window loss" else f"{d.mean:+.2f}"
        digits = 4 if name == "window loss" else 2
        p = "-" if math.isnan(d.p) else f"{d.p:.3f}"
        lines.append(f"| {name} | {mean} | {d.interval(digits)} | {p} | {d.n} |")
    return lines + [""]


def render_section(
    results: Sequence[RunResult],
    replays: Sequence[ReplayResult],
    arms: Dict[str, Arm],
    plots: Dict[str, Path],
    setup: ReportSetup,
    observing_arm: str = "none",
) -> str:
    """The ablation section of RESULTS.md."""
    comparisons = paired_comparisons(results, setup.methods, observing_arm)
    lines = [
        "## Ablation: GradientFilter, clip_grad_norm and the other gradient controls",
        "",
        f"Date: {setup.date}. Machine: {setup.machine}.",
        "",
        "Command (from `egs/librispeech/ASR`; the runs' summaries are in `ablation-runs/`):",
        "",
        "```bash",
        setup.command,
        "```",
        "",
        *setup_text(setup, results),
        "",
        column_notes(),
        "",
        format_table(results, arms, setup.methods),
        "",
    ]
    for condition in dict.fromkeys(r.key.condition for r in results):
        observed = [r for r in results if r.key.condition == condition and r.key.arm == observing_arm]
        if not observed:
            continue
        thresholds = sorted({setup.thresholds.grad_filter_threshold, *setup.thresholds.filter_sweep})
        share = [100 * outlier_steps(r) for r in observed]
        lines += [
            f"### Where the outliers arise ({condition}, arm `{observing_arm}`: the filter observes only)",
            "",
            f"Per encoder layer (top layer first; gradients flow down), over the steps after warm-up of its "
            f"{len(observed)} seed(s): the largest per-sequence gradient RMS over the batch median, and how often "
            f"it was above each threshold. Steps with some layer over {OUTLIER_RATIO:g}x, per seed: "
            + ", ".join(f"{x:.1f}%" for x in share)
            + ".",
            "",
            format_outlier_table(outlier_rows(observed, thresholds), thresholds),
            "",
        ]
    lines += [
        "### Paired differences from `none`",
        "",
        "Per seed, the arm's value minus `none`'s with the same seed (same initialisation and batches); mean, "
        "95% interval (Student's t on the per-seed differences) and the paired t-test's p. The family: every "
        f"WER comparison with at least {MIN_FAMILY_SEEDS} paired seeds, Holm-adjusted; a difference holds when "
        f"its Holm p is at most {FAMILY_ALPHA:g}. Comparisons with fewer seeds are descriptive only.",
        "",
        format_comparisons(comparisons, arms),
        "",
        *[f"- {line}" for line in findings(comparisons, arms)],
        "",
        *replay_section(
            replays,
            setup,
            {(r.key.condition, r.key.seed): r for r in results if r.key.arm == observing_arm},
        ),
        "For comparison, icefall's own ablation of the filter (lstm_transducer_stateless3, 960 h of LibriSpeech, "
        "40 epochs on 4 GPUs, epoch 40 avg 15, greedy search, test-clean / test-other; not measured here): "
        + ", ".join(f"{k} {v[0]:.2f} / {v[1]:.2f}" for k, v in icefall_greedy().items())
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
