"""The report's answer: one paragraph whose every sentence is made from a number computed here, the family's
table, one row per arm, the replays' controls and icefall's table beside it."""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from studies.ablation.arms import Arm, seeds_of
from studies.ablation.family import (
    FamilyComparison,
    FamilyRow,
    StudyConfig,
    format_family_table,
    format_p,
    power_now,
)
from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import (
    Spread,
    clips,
    decoded,
    median_clip_scale,
    plateau_exit,
    seed_ranges,
    spearman,
    spread_cell,
    steps_clipped,
    steps_filtered,
    within_group_spearman,
)
from studies.ablation.pairing import NOT_RECORDED, cpu_name, pair_runs
from studies.ablation.replay.events import MATCHED_REFERENCE, NO_CONTROL
from studies.ablation.replay.result import ReplayResult
from studies.ablation.replay.tables import format_controls_table, per_seed_means
from studies.ablation.report.common import (
    ReportSetup,
    fixed_before,
    icefall_greedy,
    icefall_published,
    plural,
    wall_sentence,
    wer_name,
)
from studies.ablation.report.figures import (
    checked_replays,
)
from studies.ablation.runs import RunResult
from studies.stats.paired import PairedDifference, paired_difference
from studies.stats.power import minimum_detectable_effect, pairs_for_power

# A clip that acts on at least NORMALISES % of the steps rescales (nearly) every step: a normalisation; one that
# acts on at most GUARDS % catches rare steps: a guard.
NORMALISES = 90.0


GUARDS = 10.0


def acts_as(acted_percent: float) -> str:
    """What a clip that lowers the norm on ``acted_percent`` % of the steps is: on (nearly) every step, a
    normalisation; on rare steps, a guard; on none, nothing; in between, neither."""
    if acted_percent >= NORMALISES:
        return f"normalisation (at least {NORMALISES:g}% of steps)"
    if acted_percent == 0:
        return "never acted"
    if acted_percent <= GUARDS:
        return f"guard (at most {GUARDS:g}% of steps)"
    return f"neither (between {GUARDS:g}% and {NORMALISES:g}% of steps)"


def arms_table(runs_of: Dict[str, List[RunResult]], arms: Dict[str, Arm], config: StudyConfig) -> str:
    """One row per arm: the primary metric at every decoding point, the step of leaving the loss plateau, how
    often the filter capped a sequence and the clip lowered the norm (mean ± sd over seeds), and the median
    clip scale; '-' where the arm has no such control."""
    method, test = config.metric
    points = sorted({step for runs in runs_of.values() for r in runs for step in decoded(r)})
    header = [
        "arm",
        "seeds",
        *[f"{wer_name(method, test)} at {step}" for step in points],
        f"left the plateau at step (loss < {config.plateau_loss:g})",
        "% steps filtered",
        "% steps clipped",
        "the clip acts as",
        "median clip scale",
    ]
    rows = []
    for arm, runs in runs_of.items():
        a = arms[arm]
        clipped = [100 * steps_clipped(r) for r in runs] if clips(a) else []
        scales = [x for x in (median_clip_scale(r) for r in runs) if math.isfinite(x)]
        clipped_mean = Spread.of(clipped)
        rows.append(
            [
                a.label,
                f"{len(runs)} ({seed_ranges(runs)})",
                *[
                    spread_cell([decoded(r).get(step, {}).get(config.metric, math.nan) for r in runs], 2)
                    for step in points
                ],
                spread_cell([plateau_exit(r, config.plateau_loss, config.plateau_window) for r in runs], 0),
                spread_cell([100 * steps_filtered(r) for r in runs], 1) if a.filter_on else "-",
                spread_cell(clipped, 1) if clipped else "-",
                acts_as(clipped_mean.mean) if clipped_mean.n else "-",
                f"{statistics.median(scales):.3f}" if clipped and scales else "-",
            ]
        )
    return markdown_table(header, rows)


def plateau_sentence(runs_of: Dict[str, List[RunResult]], setup: ReportSetup) -> str:
    """Spearman's correlation, over the runs of the table, of the step of leaving the plateau with the WER at
    the end of the budget, pooled over arms and within arms (descriptive)."""
    c = setup.config
    method = setup.methods[0]
    steps_of = {arm: [plateau_exit(r, c.plateau_loss, c.plateau_window) for r in runs] for arm, runs in runs_of.items()}
    pooled, within = [], []
    for t in TEST_SETS:
        wers_of = {arm: [r.wer.get((method, t), math.nan) for r in runs] for arm, runs in runs_of.items()}
        steps = [s for arm in runs_of for s in steps_of[arm]]
        wers = [w for arm in runs_of for w in wers_of[arm]]
        pairs = sum(1 for s, w in zip(steps, wers) if math.isfinite(s) and math.isfinite(w))
        pooled.append(f"{spearman(steps, wers):.2f} ({t}, {pairs} runs)")
        rho, used = within_group_spearman([(steps_of[arm], wers_of[arm]) for arm in runs_of])
        within.append(f"{rho:.2f} ({t}, {used} runs)")
    return (
        "Spearman's correlation of the step of leaving the plateau with the "
        f"{method.replace('_search', '')} WER at the end of the budget, over the runs of the table (descriptions, "
        "not tests): pooled over arms, which mixes the arms' differences with the seeds', "
        + ", ".join(pooled)
        + "; within arms (ranks taken and centred per arm, then pooled: does a seed that leaves the plateau "
        "earlier than its arm's other seeds end lower?), " + ", ".join(within) + "."
    )


def icefall_table(first: FamilyComparison) -> List[str]:
    """icefall's published greedy WERs without and with the filter and their difference, beside the family's
    ``first`` comparison, and remarks from icefall on other experiments (a data file; not measured here)."""
    data = icefall_published()
    greedy = icefall_greedy()
    (no_filter, without), (with_filter, filtered) = list(greedy.items())[:2]
    rows = [[name, f"{clean:.2f}", f"{other:.2f}"] for name, (clean, other) in greedy.items()]
    rows.append(
        [f"{with_filter} − {no_filter}", f"{filtered[0] - without[0]:+.2f}", f"{filtered[1] - without[1]:+.2f}"]
    )
    lines = [
        f"Beside the family's `{first.arm}` − `{first.baseline}`, one run each and no interval: {data['what']} "
        f"Sources: {'; '.join(data['sources'])}.",
        "",
        markdown_table(["icefall run", "greedy test-clean", "greedy test-other"], rows),
        "",
    ]
    for remark in data.get("remarks", []):
        lines.append(f"A remark in icefall on another experiment: {remark['text']} ({remark['source']}).")
    return lines


def lead(
    rows: Sequence[FamilyRow],
    runs_of: Dict[str, List[RunResult]],
    replays: Sequence[ReplayResult],
    setup: ReportSetup,
) -> str:
    """The answer in one paragraph: how much of the plan is in, which comparisons hold (with their size), and
    the power of the first comparison at the pairs it has."""
    c = setup.config
    ran = sum(len(runs) for runs in runs_of.values())
    if not fixed_before(c, setup.stored):
        text = (
            f"{plural(ran, 'run', 'runs')} of round {setup.stored.get('round', '?')}, made before the family of "
            f"round {c.round} was fixed: its comparisons are computed after the runs, as descriptions. "
        )
    else:
        text = f"{ran} of the {sum(c.seeds_per_arm.values())} runs planned for round {c.round}"
        if setup.planned_replays:
            text += f" and {len(replays)} of the {setup.planned_replays} planned replays"
        text += " are in. "
        text += missing_sentence(runs_of, c)
    text += wall_sentence([r for runs in runs_of.values() for r in runs], replays)
    tested = [r for r in rows if r.difference.n >= 2]
    holding = [r for r in tested if r.holm_p <= c.alpha]
    if not tested:
        return text + "No comparison of the family has 2 pairs yet."
    if holding:
        text += (
            f"Of the {plural(len(tested), 'comparison', 'comparisons')} with 2 pairs or more, "
            f"{len(holding)} {'holds' if len(holding) == 1 else 'hold'} after Holm's adjustment at family-wise "
            f"{c.alpha:g}: "
            + "; ".join(
                f"`{r.comparison.arm}` − `{r.comparison.baseline}` {r.difference.mean:+.2f} points "
                f"{r.difference.interval(2)}"
                for r in holding
            )
            + "."
        )
    else:
        text += (
            f"None of the {plural(len(tested), 'comparison', 'comparisons')} with 2 pairs or more shows a "
            f"difference at family-wise {c.alpha:g} (smallest Holm p "
            f"{format_p(min(r.holm_p for r in tested))})."
        )
    now = power_now(rows, c)
    if now is not None:
        first = c.family[0]
        text += bound_sentence(rows[0], runs_of.get(first.baseline, []), c)
        text += (
            f" `{first.arm}` − `{first.baseline}` has {now[0]} of its {c.seeds_per_arm.get(first.arm, 0)} planned "
            f"pairs: its power is {now[1]:.3f} at the effect the seeds were planned for (standardised "
            f"{c.planned_effect:+.3f}, alpha {c.alpha:g} / {len(c.family)}; planned: {c.power_target:g} at "
            f"{c.seeds_per_arm.get(first.arm, 0)} pairs), and the other comparisons have fewer planned pairs: a "
            "null at these pair counts does not show two arms equal."
        )
        text += planned_effect_sentence(rows[0], c, runs_of)
    return text


def relative_gain_here(published_change: float, published_base: float, base_here: float) -> Tuple[float, float]:
    """A published change as a share of its own baseline, and that share of the baseline here: ``(relative,
    points here)``."""
    relative = published_change / published_base
    return relative, relative * base_here


def without_linked(row: FamilyRow, c: StudyConfig) -> str:
    """The comparison without its pairs that join two CPU flag digests linked by cpus.json's check (the
    family section), as a clause; empty when it has none."""
    linked = row.pairing.linked
    if not linked:
        return ""
    keep = [s for s in row.pairing.arm_values if s not in set(linked)]
    d = paired_difference(
        {s: row.pairing.arm_values[s] for s in keep}, {s: row.pairing.baseline_values[s] for s in keep}, c.confidence
    )
    seeds = ", ".join(str(s) for s in linked)
    return (
        f"; without the {plural(len(linked), 'pair', 'pairs')} joining two CPU flag digests (seed {seeds}, the "
        f"family section), {d.mean:+.2f} {d.interval(2)}, {d.n} pairs"
    )


def bound_sentence(row: FamilyRow, baseline_runs: Sequence[RunResult], c: StudyConfig) -> str:
    """The first comparison as a bound: its interval (what the filter changes at most on this setup), its
    minimum detectable effect at the planned power and the family's alpha / m, and the pairs icefall's own
    published gain (relative to its no-filter WER, scaled to the baseline's mean here) would need at this
    comparison's spread. Empty with fewer than 2 pairs."""
    d = row.difference
    diffs = [v for v in row.per_seed.values() if math.isfinite(v)]
    if d.n < 2 or len(diffs) < 2:
        return ""
    sd = statistics.stdev(diffs)
    alpha = c.alpha / len(c.family)
    mde = minimum_detectable_effect(sd, len(diffs), alpha, c.power_target)
    text = (
        f" On this setup the filter's change of {wer_name(*c.metric)} WER (`{row.comparison.arm}` − "
        f"`{row.comparison.baseline}`) has the {100 * c.confidence:g}% interval {d.interval(2)} points ({d.n} "
        f"pairs{without_linked(row, c)}); after the fact, at the observed standard deviation {sd:.2f} of its "
        f"per-seed differences, the study would have found about {mde:.1f} points with power {c.power_target:g} "
        f"at alpha {c.alpha:g} / {len(c.family)}"
    )
    greedy = icefall_greedy()
    (_, without), (_, filtered) = list(greedy.items())[:2]
    test = TEST_SETS.index(c.metric[1]) if c.metric[1] in TEST_SETS else 1
    base_wers = [r.wer.get(c.metric, math.nan) for r in baseline_runs]
    base_wers = [w for w in base_wers if math.isfinite(w)]
    if not base_wers or sd == 0:
        return text + "."
    base = statistics.mean(base_wers)
    relative, here = relative_gain_here(filtered[test] - without[test], without[test], base)
    try:
        needed = f"about {pairs_for_power(abs(here) / sd, alpha, c.power_target, most=100_000)} pairs"
    except ValueError:
        needed = "more than 100,000 pairs"
    return text + (
        f", and icefall's own gain (its published {filtered[test] - without[test]:+.2f} on {c.metric[1]}, "
        f"{100 * relative:+.1f}% relative; here {100 * relative:+.1f}% of `{row.comparison.baseline}`'s mean "
        f"{base:.2f} over its {plural(len(base_wers), 'run', 'runs')}, about {here:+.2f} points) would need "
        f"{needed} at that spread (power {c.power_target:g}, alpha {c.alpha:g} / {len(c.family)})."
    )


def missing_sentence(runs_of: Dict[str, List[RunResult]], c: StudyConfig) -> str:
    """The planned runs not in while a later seed of their arm is (as a run skipped because its seed ran on
    another CPU is), each with the CPU models of its seed's runs that are in; empty when there is none."""
    by_seed: Dict[int, List[RunResult]] = {}
    for runs in runs_of.values():
        for r in runs:
            by_seed.setdefault(r.key.seed, []).append(r)
    parts = []
    for arm, n in c.seeds_per_arm.items():
        have = {r.key.seed for r in runs_of.get(arm, [])}
        for seed in seeds_of(c.first_seed, n):
            if seed in have or not have or seed > max(have):
                continue
            cpus = sorted({cpu_name(r.machine) or NOT_RECORDED for r in by_seed.get(seed, [])})
            where = (
                f"the runs of its seed that are in were made on {'; '.join(cpus)}"
                if cpus
                else "no run of its seed is in"
            )
            parts.append(f"`{arm}` / seed {seed} ({where})")
    return f"Not in while a later seed of its arm is: {', '.join(parts)}. " if parts else ""


def planned_effect_sentence(row: FamilyRow, c: StudyConfig, runs_of: Dict[str, List[RunResult]]) -> str:
    """Where the effect the seeds were planned for came from, in points and standardised (the mean over the
    standard deviation of the per-seed differences), beside the first comparison's own; whether its unadjusted
    interval and its interval at the plan's alpha / m hold the planned mean; and the comparison at the first
    decoding point, where the plan's effect was measured in round 1. Empty without a planned mean in family.json
    or with fewer than 2 pairs."""
    planned = c.raw.get("seeds", {}).get("power", {})
    mean = planned.get(c.metric[1], {}).get("mean")
    diffs = [v for v in row.per_seed.values() if math.isfinite(v)]
    if mean is None or len(diffs) < 2:
        return ""
    d = row.difference
    sd = statistics.stdev(diffs)
    observed = f"{d.mean / sd:+.3f}" if sd > 0 else "undefined (every difference equal)"
    level = 1 - c.alpha / len(c.family)
    wide = paired_difference(row.pairing.arm_values, row.pairing.baseline_values, level)

    def holds(x: PairedDifference) -> bool:
        return x.low <= mean <= x.high

    arm, baseline = row.comparison.arm, row.comparison.baseline
    step = c.decode_at[0]
    early = pair_runs(
        runs_of.get(arm, []),
        runs_of.get(baseline, []),
        lambda r: decoded(r).get(step, {}).get(c.metric, math.nan),
    )
    at_step = paired_difference(early.arm_values, early.baseline_values, c.confidence)
    text = (
        f" The planned effect comes from {planned['from']}, on {c.metric[1]}: {mean:+.2f} points, standardised "
        f"(mean over the standard deviation of the per-seed differences) {c.planned_effect:+.3f}; here `{arm}` − "
        f"`{baseline}` is {d.mean:+.2f} points, standardised {observed}: its unadjusted {100 * c.confidence:g}% "
        f"interval {'holds' if holds(d) else 'leaves out'} {mean:+.2f}, and its {100 * level:g}% interval (alpha "
        f"{c.alpha:g} / {len(c.family)}, as planned), {wide.interval(2)}, "
        f"{'holds it' if holds(wide) else 'leaves it out'}."
    )
    if at_step.n >= 2:
        text += (
            f" At step {step}, the same comparison is {at_step.mean:+.2f} points {at_step.interval(2)} "
            f"({at_step.n} pairs, unadjusted {100 * c.confidence:g}%)."
        )
    return text


def reference_sentence(
    replays: Sequence[ReplayResult], originals: Dict[Tuple[str, int], RunResult], setup: ReportSetup
) -> str:
    """The levels the controls' differences are taken from (each reference's loss over its window and its WERs
    at the window's end, events averaged per seed, then over seeds), how those ends were decoded, and how far
    branch (d)'s windows lie from their events'."""
    checked = checked_replays(replays, originals)
    if not checked:
        return ""
    method = setup.methods[0]

    def level(branch: str) -> str:
        with_branch = [r for r in checked if branch in r.branches]
        if not with_branch:
            return "-"
        cells = []
        for value in [
            lambda b: b.mean_loss(),
            *[lambda b, k=(method, t): b.wer.get(k, math.nan) for t in TEST_SETS],
        ]:
            means = per_seed_means([(r.key.seed, value(r.branches[branch])) for r in with_branch])
            cells.append(statistics.mean(means.values()) if means else math.nan)
        loss, *wers = cells
        return f"loss {loss:.4f}, {wer_name(method, '/'.join(TEST_SETS))} {' / '.join(f'{w:.2f}' for w in wers)}"

    text = (
        f"The references, each the mean over seeds of its events' mean: (a) over the events' windows, "
        f"{level(NO_CONTROL)}"
    )
    distances = [abs(r.matched.start - r.key.start) for r in checked if r.matched is not None]
    if distances:
        text += (
            f"; the run over (d)'s windows, {level(MATCHED_REFERENCE)}. (d)'s window starts {min(distances)} to "
            f"{max(distances)} steps from its event's (the nearest checkpoint step whose next step has every layer "
            f"under {setup.config.matched_max_ratio:g}x the batch median, its window overlapping no other "
            "replay's), at another point of training than (c)"
        )
    return (
        text + ". A window's end is decoded from its last checkpoint alone (`--avg 1`, no averaged model), "
        f"unlike the runs (`--avg {setup.config.avg} --use-averaged-model "
        f"{str(setup.config.use_averaged_model).lower()}`)."
    )


def answer_section(
    rows: Sequence[FamilyRow],
    runs_of: Dict[str, List[RunResult]],
    replays: Sequence[ReplayResult],
    measures,
    arms: Dict[str, Arm],
    labels: Dict[str, str],
    setup: ReportSetup,
    originals: Dict[Tuple[str, int], RunResult],
) -> List[str]:
    """The answer: one paragraph, the family's table, one row per arm (the metric over the budget, the head
    start out of the plateau, how often its control acted), the replays' controls, and icefall's table."""
    c = setup.config
    lines = [
        "## The answer",
        "",
        lead(rows, runs_of, replays, setup),
        "",
        f"The family ({wer_name(*c.metric)} WER (%) at the end of the budget, arm minus baseline seed by seed; "
        "how it was fixed and tested: next section; the arms: "
        + "; ".join(
            f"`{name}`: {arms[name].label}"
            for name in dict.fromkeys(x for comparison in c.family for x in (comparison.arm, comparison.baseline))
            if name in arms
        )
        + "):",
        "",
        format_family_table(rows, labels, c, c.seeds_per_arm if fixed_before(c, setup.stored) else None),
        "",
    ]
    if runs_of:
        lines += [
            f"Per arm, mean ± standard deviation over its seeds, unpaired: each row's spread holds the seeds' own "
            "and the arms need not have the same seeds, so two rows are not a comparison (those are the family's, "
            "seed by seed, above). "
            f"{wer_name(*c.metric)} WER (%); the step of leaving the plateau: counted from step 1, the first step "
            f"at which the trailing {c.plateau_window}-step mean of the training objective is below "
            f"{c.plateau_loss:g}; % steps filtered: of all steps, those at which some sequence's gradient was over "
            "the filter's cutoff (the filter rescales gradients at every step: the set-up below); % steps clipped: "
            "of all steps, those at which the clip lowered the norm; median clip scale: post- over pre-clip norm, "
            "the median over steps, then over seeds:",
            "",
            arms_table(runs_of, arms, c),
            "",
            plateau_sentence(runs_of, setup),
            "",
        ]
    if measures:
        lines += [
            "Replayed outlier events of `none` (their section below): each control minus its reference ((a) for "
            "(b), (c), (e); the run itself over the matched window for (d)) over the replay's window and at its "
            "end, over the replays whose branch (a) reproduces the run; the events of a seed averaged first, then "
            "the mean over seeds and its 95% interval (Student's t over the seeds' means; descriptions outside the "
            f"family, not adjusted for the {len(measures)} controls and their measures). % steps filtered: the "
            "control's own, not a difference (for (e), the steps at which the filter would have capped a "
            "sequence):",
            "",
            format_controls_table(measures, setup.methods),
            "",
            reference_sentence(replays, originals, setup),
            "",
        ]
    return lines + icefall_table(c.family[0]) + [""]
