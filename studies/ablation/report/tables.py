"""The report's descriptive headings: the set-up and its column definitions, where the outliers arise, the
paired differences from ``none`` and the replayed outlier events with their controls."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

from icefall_lite.train.grad_control import RELATIVE_CLIP_UPDATE_PERIOD
from icefall_lite.train.optimizer_state import EVENT_JUMP, RECOVERED_RATIO
from studies.ablation.arms import Arm
from studies.ablation.compare import Comparison, format_comparisons
from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import (
    DIVERGE_FACTOR,
    DIVERGE_WINDOW,
    OUTLIER_RATIO,
    SPIKE_FACTOR,
    SPIKE_WINDOW,
    first_and_largest,
    format_outlier_table,
    layer_outliers,
    outlier_rows,
    outlier_steps,
    plateau_exit,
)
from studies.ablation.replay.events import CONTROLS, LABELS
from studies.ablation.replay.result import ReplayResult, reproduces
from studies.ablation.replay.tables import format_events_table, format_moment_table, moment_columns
from studies.ablation.report.common import (
    ReportSetup,
    icefall_published,
)
from studies.ablation.report.figures import (
    checked_replays,
)
from studies.ablation.runs import OBJECTIVE_SIMPLE_SCALE, RunResult


def first_outliers(observed: Sequence[RunResult], beside_icefall: bool) -> List[str]:
    """Per seed of the observing arm: when it left the loss plateau, which layer went over OUTLIER_RATIO first
    after warm-up and at which step, and its largest ratio; with icefall's observation of its 12-layer
    explosion beside it (``beside_icefall``; a data file, not measured here)."""
    rows = []
    for r in sorted(observed, key=lambda r: r.key.seed):
        exit_step = plateau_exit(r)
        first, largest = first_and_largest(layer_outliers(r, OUTLIER_RATIO))
        rows.append([str(r.key.seed), "-" if math.isnan(exit_step) else f"{exit_step:.0f}", first, largest])
    header = [
        "seed",
        "left the plateau at step",
        f"first over {OUTLIER_RATIO:g}x after warm-up: layer (step)",
        "largest ratio: layer (step)",
    ]
    lines = [
        "When and where each seed's outliers began (layers numbered from the bottom, 0; the plateau as in the "
        "arms' table):",
        "",
        markdown_table(header, rows, "r" * len(header)),
        "",
    ]
    if beside_icefall:
        explosion = icefall_published()["explosion"]
        lines += [f"Beside it, not measured here: {explosion['text']}. Source: {explosion['source']}.", ""]
    return lines


def setup_text(setup: ReportSetup, results: Sequence[RunResult], arms: Dict[str, Arm]) -> List[str]:
    stored = setup.stored.get("conditions", {})
    lines = ["Conditions (each run trains from scratch; a seed fixes initialisation and batch order in every arm):", ""]
    for name in dict.fromkeys(r.key.condition for r in results):
        c = stored.get(name, {})
        steps = sorted({r.steps for r in results if r.key.condition == name})
        lines.append(
            f"- **{name}**: {'/'.join(str(x) for x in steps)} steps (`--max-batches`) at `--max-duration "
            f"{c.get('max_duration', float('nan')):g}`, train.py flags `{' '.join(c.get('flags', []))}`"
            + (f", model flags `{' '.join(setup.stored['model_args'])}`" if setup.stored.get("model_args") else "")
            + "."
        )
    ran = list(dict.fromkeys(r.key.arm for r in results))
    lines += [
        "",
        "Arms that ran: "
        + "; ".join(f"`{a}`: {arms[a].label}" for a in ran)
        + ". `none` has no control; its GradientFilter only observes (`--grad-filter-threshold inf`: per-layer "
        "statistics, gradients untouched), as in every arm without the filter.",
    ]
    if any(arms[a].value("clip_grad_norm_relative") for a in ran):
        lines[-1] += (
            " The running median of the relative clips: the upper median of the global gradient norms before "
            "clipping, re-estimated at steps 11, 21 and 41 from every norm so far and at steps "
            f"{RELATIVE_CLIP_UPDATE_PERIOD + 1}, {2 * RELATIVE_CLIP_UPDATE_PERIOD + 1}, ... from the last "
            f"{RELATIVE_CLIP_UPDATE_PERIOD} (the step's own included); no clipping at steps 1-10 (ScaledAdam's rule "
            "in icefall, on raw norms: an approximation of it)."
        )
    guard_why = setup.config.raw.get("arms", {}).get("guard_why")
    if guard_why and any(arms[a].value("clip_grad_norm") == setup.config.guard_clip_grad_norm for a in ran):
        lines[-1] += f" The guard's {setup.config.guard_clip_grad_norm:g}: {guard_why}"
    decodings = []
    for r in results:
        if r.decoding.get("use_averaged_model"):
            decodings.append(
                f"at steps {', '.join(str(s) for s in sorted(r.wer_at))} with `--avg {r.decoding['avg']} "
                f"--use-averaged-model true` (icefall's running average of the weights from checkpoint N − "
                f"{r.decoding['avg']} x `--save-every-n` to N: the last "
                f"{r.decoding['avg'] * setup.config.save_every_n} steps before step N)"
            )
        else:
            decodings.append(f"at step {r.steps} with `--avg 1` (the weights at the end, not averaged)")
    lines += ["", f"Decoding: {', '.join(setup.methods)}, " + "; ".join(dict.fromkeys(decodings)) + "."]
    return lines


def column_notes(threshold: float, warm_ends: Sequence[int]) -> str:
    """The definitions of :func:`format_table`'s columns; ``warm_ends``: the first step at the full loss weights
    of each condition (2 x --model-warm-step)."""
    return (
        "Each cell: mean ± standard deviation over the seeds ((n=k): only k seeds had a finite value), but for "
        "max seq grad / median, max exp_avg_sq jump and recovery steps, whose tails one seed can dominate: median "
        "[smallest, largest] over the seeds. WER (%) at "
        f"the end of the budget. Warm-up: the steps before step {' / '.join(str(w) for w in warm_ends)} (2 x "
        "`--model-warm-step`, W): the pruned loss's weight is 0 before step W, 1 at step W (icefall's step ramp at "
        "warm-up exactly 1), 0.1 after it and 1 from step 2W. Losses are of the objective with its "
        f"weights after warm-up ({OBJECTIVE_SIMPLE_SCALE:g} x simple + pruned, per frame), at every step from 1; "
        "final train loss: the mean over the last "
        "tenth of the steps; valid loss: dev-clean + dev-other at the end. Loss spikes: steps after warm-up whose "
        f"loss is over {SPIKE_FACTOR:g}x the median of the (up to) {SPIKE_WINDOW} steps after warm-up before it. "
        f"Diverged: a skipped (non-finite) step, or a last-{DIVERGE_WINDOW}-step mean over {DIVERGE_FACTOR:g}x its "
        f"lowest. % steps > {OUTLIER_RATIO:g}x: steps after warm-up at which some layer's largest per-sequence "
        "gradient RMS was over that multiple of the batch median (measured before that layer's filter). % steps "
        "filtered: of all steps, those at which some layer's filter met a sequence whose gradient RMS n_b was "
        "above its cutoff c (threshold x the batch median). The filter wraps each layer's LSTM, is soft and acts at "
        "every step: it scales the gradient the LSTM sends back to its input by c / (c + n_b) per sequence "
        f"({threshold / (threshold + 1):.3f} at the median for threshold {threshold:g}; that part stays below c "
        "however large n_b, while the layer's residual path passes its gradient on unfiltered), and the LSTM's "
        "weight gradients uniformly by 1 / (1 + mean(n_b) / c). % steps "
        "clipped: the clipping lowered the gradient norm. Max "
        "exp_avg_sq jump: after warm-up, the largest ratio of a parameter tensor's Adam second moment "
        f"(sum of exp_avg_sq) after a step to before it; % steps jump > {EVENT_JUMP:g}: how often a step inflated "
        f"some tensor's second moment that much; recovery steps: the median number of steps such a tensor took to "
        f"come back to {RECOVERED_RATIO:g}x its value before the jump (events not recovered by the end of the run "
        "are not counted). Wall min: training and decoding as the run recorded them; a run paused, or sharing the "
        "cores with another job, counts that time too, so it is no measure of an arm's speed."
    )


def replay_section(
    replays: Sequence[ReplayResult],
    measures,
    setup: ReportSetup,
    originals: Dict[Tuple[str, int], RunResult],
) -> List[str]:
    if not replays:
        return []
    threshold = setup.thresholds.grad_filter_threshold
    same = sum(r.identical_batches for r in replays)
    checked = [(r, originals.get((r.key.condition, r.key.seed))) for r in replays]
    reproduced = sum(1 for r, o in checked if o is not None and reproduces(r, o))
    seeds = len({r.key.seed for r in replays})
    branches = [b for b in CONTROLS if any(b in r.branches for r in replays)]
    matched = sum(1 for r in replays if r.matched is not None)
    lines = [
        "## Replayed outlier events, with controls",
        "",
        f"{len(replays)} replays of {setup.planned_replays} planned, from {seeds} seed(s) of `none`. Each resumes "
        "the run at the step just before an outlier event (a step after warm-up with a layer over "
        f"{threshold:g}x the batch median; per seed the largest events whose windows do not overlap) and trains "
        f"{replays[0].steps} steps on the same batches in branches that differ only in the gradient control: "
        + "; ".join(LABELS[b] for b in ["none", *branches])
        + f". Branch (d) ran in {matched} of {len(replays)} replays (it needs a matched step). Same batches: the batch "
        f"digests agree at every step ({same} of {len(replays)}); branch (a) reproduces the run's loss, checked at "
        f"every step of the window, in {reproduced} of {len(replays)} (the others are left out below).",
        "",
        format_events_table(replays, originals),
        "",
    ]
    if measures:
        lines += ["Each control minus its reference: the answer's table above.", ""]
    columns = moment_columns(checked_replays(replays, originals), lambda r: r.tensors)
    if columns:
        lines += [
            "Adam's second moment per layer (exp_avg_sq summed over the layer's tensors of more than one element; "
            "the one-element tensors, log-scales and BasicNorm's eps, left out): the no-control branch's over the "
            "control's, at the event step (after its update) and at the window's end; above 1: larger without the "
            "control (a second moment, not a step size: the update also scales with the first moment). "
            "Median over events [smallest, largest] (events):",
            "",
            format_moment_table(columns),
            "",
        ]
    return lines


def outliers_sections(results: Sequence[RunResult], setup: ReportSetup, observing_arm: str) -> List[str]:
    """Per condition with runs of the observing arm: where the outliers arise, per layer and per seed."""
    lines: List[str] = []
    for cond in dict.fromkeys(r.key.condition for r in results):
        observed = [r for r in results if r.key.condition == cond and r.key.arm == observing_arm]
        if not observed:
            continue
        thresholds = sorted({setup.thresholds.grad_filter_threshold, *setup.thresholds.filter_sweep})
        share = [100 * outlier_steps(r) for r in observed]
        lines += [
            f"## Where the outliers arise ({cond}, arm `{observing_arm}`: the filter observes only)",
            "",
            f"Per encoder layer (top layer first; gradients flow down), over the steps after warm-up of its "
            f"{len(observed)} seed(s): the largest per-sequence gradient RMS over the batch median, and how often "
            f"it was above each threshold. Steps with some layer over {OUTLIER_RATIO:g}x, per seed: "
            + ", ".join(f"{x:.1f}%" for x in share)
            + ".",
            "",
            format_outlier_table(outlier_rows(observed, thresholds), thresholds),
            "",
            *first_outliers(observed, cond == setup.config.depth_condition),
        ]
    return lines


def paired_section(comparisons: Sequence[Comparison], arms: Dict[str, Arm]) -> List[str]:
    """Every arm minus ``none``, described (not tested)."""
    return [
        "## Paired differences from `none`, described",
        "",
        "Every arm minus `none`, seed by seed (runs on two CPU models not paired): mean and 95% interval, for every "
        "WER and the validation loss. Descriptions, not tests (the tests are the family's).",
        "",
        format_comparisons(comparisons, arms),
        "",
    ]
