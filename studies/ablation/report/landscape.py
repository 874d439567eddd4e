"""The report's family of comparisons (how it was fixed and tested) and the clipping landscape (every other
rule against ``none``, a family of its own), with what a family of that many pairs can see."""

from __future__ import annotations

import math
import re
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from scipy import stats

from studies.ablation.arms import Arm, seeds_of
from studies.ablation.family import (
    FamilyComparison,
    FamilyRow,
    StudyConfig,
    family_rows,
    family_verdicts,
    format_p,
    landscape_rule,
)
from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import (
    clips,
    counts_what_it_applies,
    median_clip_scale,
    steps_acting,
)
from studies.ablation.report.common import (
    ReportSetup,
    plural,
    round_note,
    time_lines,
    wer_name,
)
from studies.ablation.report.figures import (
    same_batches,
)
from studies.ablation.runs import RunResult
from studies.stats.paired import PairedDifference, holm_adjust, paired_difference, welch_difference
from studies.stats.power import effect_for_power, minimum_detectable_effect


def family_section(
    rows: Sequence[FamilyRow], setup: ReportSetup, results: Sequence[RunResult], condition: str
) -> List[str]:
    c = setup.config
    straddling = sum(len(r.pairing.straddling) for r in rows)
    unchecked = sum(len(r.pairing.unchecked) for r in rows)
    agree, pairs = same_batches(rows, results, condition)
    return [
        "## The family of comparisons",
        "",
        round_note(c, setup.stored)
        + f" Metric: {wer_name(*c.metric)} WER (%) at the end of the budget. Per seed, the arm's value minus the "
        "baseline's (same initialisation and batches); mean, "
        f"{100 * c.confidence:g}% interval (Student's t on the per-seed differences, not adjusted for the "
        "family), Holm's adjustment of the "
        f"paired t-test's p over the {len(c.family)} comparisons (a difference holds when its Holm p is at most "
        f"{c.alpha:g}), and beside it the exact Wilcoxon signed-rank test's p (unadjusted); the table is in the "
        "answer above.",
        "",
        f"Pairs left out because their two runs ran on different CPU models: {straddling}. "
        + linked_sentence(rows, setup)
        + f" Pairs kept whose CPU "
        f"model is not recorded (not checked): {unchecked}. Pairs whose two runs logged the same batch digest at "
        "every step (the same utterances in the same order; the digest hashes the cut ids, not the noise mixed "
        f"in): {agree} of {pairs}.",
        "",
        sensitivity_sentence(rows, c, len(c.family)),
        "",
    ]


# The day the plan's rule (pairs made on two CPU models are left out) was amended to keep the pairs whose two
# CPUs cpus.json's check showed to compute alike.
LINKED_AMENDED = "2026-11-28"


def without_seeds(row: FamilyRow, seeds: Sequence[int], confidence: float) -> PairedDifference:
    """``row``'s paired difference over its pairs other than ``seeds``."""
    keep = [s for s in row.pairing.arm_values if s not in set(seeds)]
    return paired_difference(
        {s: row.pairing.arm_values[s] for s in keep}, {s: row.pairing.baseline_values[s] for s in keep}, confidence
    )


def linked_sentence(rows: Sequence[FamilyRow], setup: ReportSetup) -> str:
    """How many pairs of each comparison join runs of two recorded CPUs (flag digests) that cpus.json's check
    showed to compute alike, marked as the dated amendment to the plan that it is, and the first comparison
    without those pairs."""
    c = setup.config
    total = sum(len(r.pairing.linked) for r in rows)
    checked = [r for r in getattr(setup, "reproductions", ()) if r.reproduced]
    how = (
        f"cpus.json's check (its {checked[0].steps}-step retraining of one seed per arm)"
        if checked
        else "cpus.json's check"
    )
    text = (
        f"Pairs joining two CPU flag digests, linked by {how}: {total}"
        + (
            " ("
            + ", ".join(
                f"`{r.comparison.arm}` − `{r.comparison.baseline}` {len(r.pairing.linked)}"
                + (f" (seed {', '.join(str(s) for s in r.pairing.linked)})" if 0 < len(r.pairing.linked) <= 3 else "")
                for r in rows
            )
            + ")"
            if total
            else ""
        )
        + "."
    )
    if not total:
        return text
    text += (
        f" Amended on {LINKED_AMENDED}: the plan left out pairs whose runs ran on different CPU models; these are "
        "kept on that check."
    )
    first = rows[0]
    if first.pairing.linked:
        d = without_seeds(first, first.pairing.linked, c.confidence)
        if d.n < 2:
            return text + (
                f" Without them, `{first.comparison.arm}` − `{first.comparison.baseline}` keeps "
                f"{plural(d.n, 'pair', 'pairs')}: every comparison here rests on that check."
            )
        text += (
            f" Without them, `{first.comparison.arm}` − `{first.comparison.baseline}` is {d.mean:+.2f} "
            f"{d.interval(2)} ({d.n} pairs, unadjusted {100 * c.confidence:g}%), against {first.difference.mean:+.2f} "
            f"{first.difference.interval(2)} ({first.difference.n} pairs) with them."
        )
    return text


def landscape_section(results: Sequence[RunResult], arms: Dict[str, Arm], setup: ReportSetup) -> List[str]:
    """The landscape (family.json's "landscape": every other rule against ``none``, a family of its own), once
    one of its arms has runs: per rule its granularity and what it reacts to (as family.json states them), %
    of steps it acted on, and its paired difference from ``none`` with Holm over the landscape's comparisons,
    every figure over the landscape's seeds."""
    c = setup.config
    names = {comparison.arm for comparison in c.landscape_family}
    if not any(r.key.arm in names for r in results):
        return []
    # Every row over the landscape's seeds, the round's filter among them (the reference row, and the filter
    # against each rule).
    seeds = seeds_of(c.first_seed, c.landscape_seeds)
    within = [r for r in results if r.key.condition == c.condition and r.key.seed in seeds]
    rows = family_rows(within, c, c.condition, c.landscape_family)
    landscape_runs = [r for r in within if r.key.arm in names]
    first = c.family[0]
    header = [
        "rule",
        "granularity",
        "reacts to",
        "% steps acting",
        "median clip scale",
        "pairs",
        "mean difference",
        f"{100 * c.confidence:g}% interval (unadjusted)",
        "Holm p",
        "signed-rank p",
        "verdict",
        f"`{first.arm}` − rule: mean [{100 * c.confidence:g}% interval] (unadjusted)",
    ]

    def cells_of(row: FamilyRow, label: str, kind: Tuple[str, str], holm: str, said: str) -> List[str]:
        arm = row.comparison.arm
        runs = [r for r in within if r.key.arm == arm]
        acting = [100 * steps_acting(r, arms[arm]) for r in runs]
        acting = [x for x in acting if math.isfinite(x)]
        scales = [x for x in (median_clip_scale(r) for r in runs) if math.isfinite(x)] if clips(arms[arm]) else []
        d = row.difference
        return [
            label,
            *kind,
            f"{statistics.mean(acting):.1f}" if acting else "-",
            f"{statistics.median(scales):.3f}" if scales else "-",
            str(d.n),
            "-" if math.isnan(d.mean) else f"{d.mean:+.2f}",
            d.interval(2),
            holm,
            format_p(row.signed_rank.p),
            said,
            against_filter(arm),
        ]

    def against_filter(arm: str) -> str:
        """The round's filter minus the rule, seed by seed over the landscape's seeds: where the filter stands
        against it directly (a description, in neither family)."""
        if arm == first.arm:
            return "-"
        d = family_rows(within, c, c.condition, [FamilyComparison(first.arm, arm)])[0].difference
        if d.n == 0:
            return "-"
        return f"{d.mean:+.2f} {d.interval(2)}" if d.n >= 2 else f"{d.mean:+.2f} (1 pair)"

    # The yardstick: the round's first comparison (the filter at its default against none) over the
    # landscape's seeds, with the granularity of the landscape's filters; outside the landscape's Holm.
    yardstick = family_rows(within, c, c.condition, [first])[0]
    kinds = [landscape_rule(c, x.arm)[1:] for x in c.landscape_family if arms[x.arm].filter_on]
    cells = []
    if yardstick.difference.n and kinds and arms[first.arm].filter_on:
        said = (
            f"outside this family: the round's `{first.arm}` − `{first.baseline}` over seeds {seeds[0]}-{seeds[-1]} "
            f"(p {format_p(yardstick.difference.p)}, unadjusted)"
        )
        cells.append(cells_of(yardstick, f"{arms[first.arm].label} (the round's, for reference)", kinds[0], "-", said))
    for row, words in zip(rows, family_verdicts(rows, c.alpha, [c.landscape_seeds] * len(rows))):
        arm = row.comparison.arm
        cells.append(cells_of(row, arms[arm].label, landscape_rule(c, arm)[1:], format_p(row.holm_p), words))
    return [
        "## The clipping landscape",
        "",
        f"Every other rule minus `none`, seed by seed, on {wer_name(*c.metric)} WER (%) at the end of the budget; "
        f"Holm over these {len(rows)} comparisons, apart from the family above; each rule's threshold and its "
        "reason are listed below the table; the first row, for reference and outside that Holm, is the round's "
        f"`{first.arm}` − `{first.baseline}` over the same seeds. % steps acting: mean over the rule's runs of the "
        "% of steps at which its own statistic says it changed a gradient (the filters: a sequence over the "
        "cutoff) ('-': no run logged it); median clip scale: of the rules that change the gradients after "
        "backward, the global norm after over before, the median over steps, then over seeds ('-': a rule that "
        "acts inside backward, or no run logged it). The last column compares the filter with each rule "
        f"directly: the round's `{first.arm}` minus the rule, seed by seed over the same seeds (its mean and "
        "unadjusted interval, a description in neither family; below 0: the filter's WER lower).",
        "",
        markdown_table(header, cells),
        "",
        linked_sentence(rows, setup),
        "",
        *holding_lines(rows, within, arms, c),
        *against_all_lines(results, rows, c),
        *idle_lines(landscape_runs, arms, rows, family_rows(results, c, c.condition, [first])[0], results, c),
        *time_lines(landscape_runs),
        'The thresholds, as fixed before the runs (`studies/ablation/family.json`, "landscape"):',
        "",
        *(f"- `{row.comparison.arm}`: {landscape_rule(c, row.comparison.arm)[0]}" for row in rows),
        "",
        sensitivity_sentence(rows, c, len(rows)),
        "",
    ]


def acting_percent(runs: Sequence[RunResult], arm: Arm) -> float:
    """Mean over ``runs`` of the % of steps at which ``arm``'s own statistic says it acted (nan: none logged)."""
    acting = [100 * steps_acting(r, arm) for r in runs]
    acting = [x for x in acting if math.isfinite(x)]
    return statistics.mean(acting) if acting else math.nan


def holding_lines(
    rows: Sequence[FamilyRow], runs: Sequence[RunResult], arms: Dict[str, Arm], c: StudyConfig
) -> List[str]:
    """For each rule whose difference holds after Holm: that it holds for its threshold, at the % of steps it
    acted on there, with where the threshold came from (family.json's reason), not for the rule at others."""
    lines = []
    for row in rows:
        if not row.holm_p <= c.alpha:
            continue
        arm = arms[row.comparison.arm]
        acting = acting_percent([r for r in runs if r.key.arm == arm.name], arm)
        reason = re.search(r"\(the threshold from ([^),]*)", landscape_rule(c, arm.name)[0])
        where = f", a threshold taken from {reason.group(1)}" if reason else ""
        lines += [
            f"`{arm.name}` − `{row.comparison.baseline}` {row.difference.mean:+.2f} (Holm p {format_p(row.holm_p)}) "
            f"holds for this threshold ({arm.label}{where}), at which it acted on {acting:.1f}% of steps; not shown "
            "for the rule as normally used.",
            "",
        ]
    return lines


def against_all_lines(results: Sequence[RunResult], rows: Sequence[FamilyRow], c: StudyConfig) -> List[str]:
    """Every landscape rule's mean minus the mean of every `none` run on the condition (unpaired: Welch's t
    interval, Holm over the rules), beside the paired row over the landscape's seeds, and which verdicts differ
    (an unadjusted interval that leaves out 0 in one and not the other; Holm at alpha). Empty when `none` has no
    more runs than the landscape's seeds."""
    on = [r for r in results if r.key.condition == c.condition]
    baseline = rows[0].comparison.baseline if rows else "none"
    base = [r.wer.get(c.metric, math.nan) for r in on if r.key.arm == baseline]
    base = [w for w in base if math.isfinite(w)]
    seeds = seeds_of(c.first_seed, c.landscape_seeds)
    if len(base) <= len(seeds) or not rows:
        return []
    shared = [r.wer.get(c.metric, math.nan) for r in on if r.key.arm == baseline and r.key.seed in seeds]
    others = [r.wer.get(c.metric, math.nan) for r in on if r.key.arm == baseline and r.key.seed not in seeds]
    diffs = [
        welch_difference(
            [r.wer.get(c.metric, math.nan) for r in on if r.key.arm == row.comparison.arm and r.key.seed in seeds],
            base,
            c.confidence,
        )
        for row in rows
    ]
    holm = holm_adjust([d.p for d in diffs])
    ci = f"{100 * c.confidence:g}%"

    def excludes(low: float, high: float) -> bool:
        return low > 0 or high < 0

    cells, changed = [], []
    for row, d, h in zip(rows, diffs, holm):
        p = row.difference
        paired_out, welch_out = excludes(p.low, p.high), excludes(d.low, d.high)
        paired_holds, welch_holds = row.holm_p <= c.alpha, h <= c.alpha
        notes = []
        if paired_out != welch_out:
            notes.append(f"unadjusted interval {'now leaves out' if welch_out else 'no longer leaves out'} 0")
        if paired_holds != welch_holds:
            notes.append(f"{'now holds' if welch_holds else 'no longer holds'} after Holm")
        if notes:
            changed.append(f"`{row.comparison.arm}` ({', '.join(notes)})")
        cells.append(
            [
                f"`{row.comparison.arm}`",
                str(d.n),
                f"{d.mean:+.2f}",
                d.interval(2),
                format_p(h),
                f"{p.mean:+.2f} {p.interval(2)}",
                "; ".join(notes) if notes else "same",
            ]
        )
    header = [
        "rule",
        "runs",
        f"mean − mean of all {len(base)} `{baseline}` runs",
        f"{ci} interval (Welch, unadjusted)",
        "Holm p (Welch)",
        f"paired over seeds {seeds[0]}-{seeds[-1]} (above)",
        "verdict against the paired row",
    ]
    return [
        f"The landscape's shared `{baseline}` seeds {seeds[0]}-{seeds[-1]} have a mean of "
        f"{statistics.mean([w for w in shared if math.isfinite(w)]):.2f}, and its other "
        f"{plural(len([w for w in others if math.isfinite(w)]), 'seed', 'seeds')} a mean of "
        f"{statistics.mean([w for w in others if math.isfinite(w)]):.2f}. Each rule against all {len(base)} "
        f"`{baseline}` runs on `{c.condition}` ({wer_name(*c.metric)} WER (%) at the end of the budget), unpaired: "
        f"the difference of the means, Welch's t {ci} interval, Holm over these {len(rows)}:",
        "",
        markdown_table(header, cells),
        "",
        "Verdicts that change against all runs: " + ("; ".join(changed) if changed else "none") + ".",
        "",
    ]


def spread_and_pairing(reference: FamilyRow) -> Tuple[float, float, int]:
    """``(standard deviation of the per-seed differences, Pearson's correlation of the baseline's and the
    arm's values over the seeds, seeds)`` of ``reference``: how much pairing by seed removes (nan with fewer
    than 3 seeds or a constant side)."""
    seeds = sorted(reference.pairing.arm_values)
    a = [reference.pairing.arm_values[s] for s in seeds]
    b = [reference.pairing.baseline_values[s] for s in seeds]
    sd = statistics.stdev([x - y for x, y in zip(a, b)]) if len(seeds) >= 2 else math.nan
    if len(seeds) < 3 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
        return sd, math.nan, len(seeds)
    return sd, float(stats.pearsonr(b, a).statistic), len(seeds)


def idle_lines(
    runs: Sequence[RunResult],
    arms: Dict[str, Arm],
    rows: Sequence[FamilyRow],
    reference: Optional[FamilyRow] = None,
    results: Sequence[RunResult] = (),
    config: Optional[StudyConfig] = None,
) -> List[str]:
    """For each rule whose every run logged that it changed no gradient at any step (% steps acting 0, by a
    statistic that counts what was applied): a sentence that its row is no effect of the rule at its
    threshold. Such a run does ``none``'s arithmetic; where the rule's presence changes the computation's path
    (the recurrent cap runs the LSTM frame by frame, outside PyTorch's fused kernel) it rounds differently, and
    its difference from ``none`` is what rounding alone did to the WER: a placebo."""
    lines = []
    for row in rows:
        arm = arms[row.comparison.arm]
        if not counts_what_it_applies(arm):
            continue
        acting = [steps_acting(r, arm) for r in runs if r.key.arm == arm.name]
        if not acting or any(x != 0.0 for x in acting):  # nan (not logged) is not 0
            continue
        d = row.difference
        said = f"{d.mean:+.2f}, {plural(d.n, 'pair', 'pairs')}" if d.n else "no pair yet"
        head = (
            f"`{arm.name}` ({arm.label}) changed no gradient at any step of its {plural(len(acting), 'run', 'runs')}: "
            "its row is no effect of the rule at this threshold. "
        )
        if arm.value("recurrent_grad_clip") > 0:
            tail = (
                "Its runs do `none`'s arithmetic in another order (with the cap in place the LSTM runs frame by "
                "frame, not in PyTorch's fused kernel): a placebo, whose difference from `none` is what rounding "
                "alone did to the WER."
            )
            if reference is not None and d.n >= 2 and reference.difference.n >= 3:
                own, _, _ = spread_and_pairing(row)
                sd, r, n = spread_and_pairing(reference)
                name = f"`{reference.comparison.arm}` − `{reference.comparison.baseline}`"
                tail += (
                    f" Its lesson is the spread: the standard deviation of its per-seed differences from `none` is "
                    f"{own:.3f} ({plural(d.n, 'pair', 'pairs')}), that of {name} {sd:.3f} ({n} pairs), so the "
                    f"filter's differences are as wide as a rule that changed nothing; and pairing by seed carries "
                    f"almost nothing: Pearson's correlation of `{reference.comparison.baseline}`'s and "
                    f"`{reference.comparison.arm}`'s WER over their {n} shared seeds is {r:.2f}."
                )
            if config is not None:
                on = [x for x in results if x.key.condition == config.condition]
                base = [x.wer.get(config.metric, math.nan) for x in on if x.key.arm == row.comparison.baseline]
                mine = [x.wer.get(config.metric, math.nan) for x in runs if x.key.arm == arm.name]
                w = welch_difference(mine, base, config.confidence)
                if w.n >= 2 and math.isfinite(w.low) and w.high > w.low:
                    tail += (
                        f" Against all {len([x for x in base if math.isfinite(x)])} `{row.comparison.baseline}` "
                        f"runs (unpaired, above) it is {w.mean:+.2f} {w.interval(2)}."
                    )
        else:
            tail = f"Its runs do `none`'s arithmetic, so its difference from `none` ({said}) measures no rule."
        lines += [head + tail, ""]
    return lines


def detectable_parts(rows: Sequence[FamilyRow], alpha: float, target: float) -> List[Tuple[str, int, float, float]]:
    """Per comparison with at least 2 pairs: ``(name, pairs, sd of its per-seed differences, its minimum
    detectable effect in points)`` at level ``alpha`` and power ``target``, from its own spread."""
    parts = []
    for row in rows:
        diffs = [v for v in row.per_seed.values() if math.isfinite(v)]
        if len(diffs) < 2:
            continue
        sd = statistics.stdev(diffs)
        name = f"`{row.comparison.arm}` − `{row.comparison.baseline}`"
        parts.append((name, len(diffs), sd, minimum_detectable_effect(sd, len(diffs), alpha, target)))
    return parts


def sensitivity_sentence(rows: Sequence[FamilyRow], config: StudyConfig, m: int) -> str:
    """What a family of ``m`` comparisons can see, each comparison from its own spread: the mean difference at
    which Holm's first step (alpha / m) reaches the planned power with its pairs, at the standard deviation of
    its per-seed differences (its minimum detectable effect)."""
    alpha = config.alpha / m
    parts = detectable_parts(rows, alpha, config.power_target)
    if not parts:
        return ""
    sds = [p[2] for p in parts]
    mdes = [p[3] for p in parts]
    counts = sorted({p[1] for p in parts})
    effects = ", ".join(f"{effect_for_power(n, alpha, config.power_target):.2f} at {n} pairs" for n in counts)
    return (
        f"What these pairs can see, each comparison from its own spread: the paired t at {config.alpha:g} / {m} "
        f"(Holm's first step) reaches power {config.power_target:g} only at a standardised effect (mean over the "
        f"standard deviation of the per-seed differences) of {effects}; times each comparison's standard "
        f"deviation, its minimum detectable effect at power {config.power_target:g} (alpha {config.alpha:g} / {m}): "
        + "; ".join(f"{name} {mde:.1f} points (sd {sd:.2f}, {n} pairs)" for name, n, sd, mde in parts)
        + f" (sd {min(sds):.2f}-{max(sds):.2f}: about {min(mdes):.1f}-{max(mdes):.1f} points). A smaller "
        "difference can sit inside a null here."
    )
