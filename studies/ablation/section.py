"""The ablation section of RESULTS.md: the answer (every sentence made from a number computed here), the
family of comparisons fixed before the runs, WER at each decoding point, the set-up of
the runs that ran, the table per arm, where the outliers arise, descriptive paired differences, the replays
with their controls, icefall's own table and remarks beside it, the pilot, the plots and every command."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.grad_control import RELATIVE_CLIP_UPDATE_PERIOD
from icefall_lite.train.optimizer_state import EVENT_JUMP, RECOVERED_RATIO
from studies.ablation.arms import Arm, Thresholds, seeds_of
from studies.ablation.compare import Comparison, format_comparisons, paired_comparisons
from studies.ablation.cpus import Reproduction
from studies.ablation.family import (
    FamilyComparison,
    FamilyRow,
    StudyConfig,
    family_rows,
    family_verdicts,
    format_family_table,
    format_p,
    landscape_rule,
    power_now,
)
from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import (
    DIVERGE_FACTOR,
    DIVERGE_WINDOW,
    OUTLIER_RATIO,
    SPIKE_FACTOR,
    SPIKE_WINDOW,
    Spread,
    clips,
    counts_what_it_applies,
    decoded,
    first_and_largest,
    format_outlier_table,
    format_table,
    format_wer_curves,
    group_runs,
    layer_outliers,
    median_clip_scale,
    outlier_rows,
    outlier_steps,
    plateau_exit,
    seed_ranges,
    spearman,
    spread_cell,
    steps_acting,
    steps_clipped,
    steps_filtered,
    within_group_spearman,
)
from studies.ablation.paired import PairedDifference, paired_difference
from studies.ablation.pairing import NOT_RECORDED, cpu_name, pair_runs
from studies.ablation.power import effect_for_power
from studies.ablation.replay import (
    CONTROLS,
    LABELS,
    MATCHED_REFERENCE,
    NO_CONTROL,
    ReplayResult,
    control_measures,
    format_controls_table,
    format_events_table,
    format_moment_table,
    moment_columns,
    per_seed_means,
    reproduces,
)
from studies.ablation.runs import OBJECTIVE_SIMPLE_SCALE, RunResult
from studies.runner import Section

SECTION = Section("ablation", "lstm_transducer_stateless/ablation.py")
# A clip that acts on at least NORMALISES % of the steps rescales (nearly) every step: a normalisation; one that
# acts on at most GUARDS % catches rare steps: a guard.
NORMALISES = 90.0
GUARDS = 10.0
# icefall's own ablation of the filter, with its source (a data file: not measured here).
ICEFALL_PUBLISHED = Path(__file__).with_name("icefall_published.json")


def icefall_published() -> Dict:
    return json.loads(ICEFALL_PUBLISHED.read_text(encoding="utf-8"))


def icefall_greedy() -> Dict[str, Tuple[float, float]]:
    """``{arm: (test-clean, test-other)}``: icefall's published greedy-search WERs without and with the filter."""
    data = icefall_published()
    return {arm: (wers["test-clean"], wers["test-other"]) for arm, wers in data["greedy_search"].items()}


@dataclass
class ReportSetup:
    """What the study says about its runs: the command, the round's configuration, where the summaries are and
    the settings stored with them, the thresholds, the decoding methods, the replays planned, the date and
    the machine of the report, and the CPUs shown to compute as others (:mod:`studies.ablation.cpus`)."""

    command: str
    config: StudyConfig
    summaries: str
    stored: Dict
    thresholds: Thresholds
    methods: Sequence[str]
    planned_replays: int
    date: str
    machine: str
    reproductions: Sequence[Reproduction] = ()
    waiting: Sequence[str] = ()  # runs trained to fewer steps than their condition's budget: "<relpath> (n of N)"


def _wer_name(method: str, test_set: str) -> str:
    return f"{method.replace('_search', '')} {test_set}"


def _cpu_line(results: Sequence[RunResult], replays: Sequence[ReplayResult]) -> str:
    counts: Dict[str, int] = {}
    for r in [*results, *replays]:
        name = cpu_name(r.machine) or NOT_RECORDED
        counts[name] = counts.get(name, 0) + 1
    return "; ".join(f"{name}: {n} run(s)/replay(s)" for name, n in sorted(counts.items()))


def reproductions_sentence(reproductions: Sequence[Reproduction], summaries: str) -> str:
    """What each check of one CPU against another's runs found (empty without one)."""
    parts = []
    for r in reproductions:
        found = (
            f"with torch {r.torch} reproduced every one of the first {r.steps} steps of "
            f"{_plural(len(r.runs), 'run', 'runs')} made on {r.of} ({', '.join(sorted(r.runs))}: batch digest, "
            "losses and gradient norm to the summaries' 7 digits), so on "
            f"{', '.join(f'`{c}`' for c in r.conditions)} its runs pair with that CPU's (the other seeds, the later "
            "steps and the decodings are assumed to reproduce too, not checked)"
            if r.reproduced
            else f"with torch {r.torch} did not reproduce runs made on {r.of} ("
            + ", ".join(
                f"{relpath} {'matched' if step is None else f'parts at step {step}'}"
                for relpath, step in sorted(r.runs.items())
            )
            + f", of {r.steps} steps retrained): its runs do not pair with that CPU's"
        )
        parts.append(f"On {r.date}, {r.cpu} {found}")
    if not parts:
        return ""
    return " " + "; ".join(parts) + f" (`{summaries}/cpus.json`, `ablation.py --verify-cpu`)."


def fixed_before(setup: StudyConfig, stored: Dict) -> bool:
    """Whether the summaries are of the round whose family was fixed before its runs."""
    return stored.get("round") == setup.round


def _round_note(setup: StudyConfig, stored: Dict) -> str:
    if fixed_before(setup, stored):
        return (
            f"The family, its test and the seed counts were fixed on {setup.fixed} before the runs of round "
            f"{setup.round} (`studies/ablation/family.json`)."
        )
    return (
        f"These runs predate the family (fixed on {setup.fixed} for round {setup.round}, "
        "`studies/ablation/family.json`): its comparisons are computed here after the fact, as descriptions."
    )


def same_batches(rows: Sequence[FamilyRow], results: Sequence[RunResult], condition: str) -> Tuple[int, int]:
    """``(pairs whose two runs logged the same batch digest at every step, pairs of the family)``: a pair whose
    runs lack digests counts as not the same."""
    digests = {(r.key.arm, r.key.seed): r.series("batch_digest") for r in results if r.key.condition == condition}
    pairs = [(row.comparison, seed) for row in rows for seed in row.per_seed]
    agree = sum(
        1
        for comparison, seed in pairs
        if digests.get((comparison.arm, seed))
        and digests.get((comparison.arm, seed)) == digests.get((comparison.baseline, seed))
    )
    return agree, len(pairs)


def family_section(
    rows: Sequence[FamilyRow], setup: ReportSetup, results: Sequence[RunResult], condition: str
) -> List[str]:
    c = setup.config
    straddling = sum(len(r.pairing.straddling) for r in rows)
    unchecked = sum(len(r.pairing.unchecked) for r in rows)
    agree, pairs = same_batches(rows, results, condition)
    return [
        "### The family of comparisons",
        "",
        _round_note(c, setup.stored)
        + f" Metric: {_wer_name(*c.metric)} WER (%) at the end of the budget. Per seed, the arm's value minus the "
        "baseline's (same initialisation and batches); mean, "
        f"{100 * c.confidence:g}% interval (Student's t on the per-seed differences, not adjusted for the "
        "family), Holm's adjustment of the "
        f"paired t-test's p over the {len(c.family)} comparisons (a difference holds when its Holm p is at most "
        f"{c.alpha:g}), and beside it the exact Wilcoxon signed-rank test's p (unadjusted); the table is in the "
        "answer above.",
        "",
        f"Pairs left out because their two runs ran on different CPU models: {straddling}. Pairs kept whose CPU "
        f"model is not recorded (not checked): {unchecked}. Pairs whose two runs logged the same batch digest at "
        "every step (the same utterances in the same order; the digest hashes the cut ids, not the noise mixed "
        f"in): {agree} of {pairs}.",
        "",
    ]


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
        "### The clipping landscape",
        "",
        f"Every other rule minus `none`, seed by seed, on {_wer_name(*c.metric)} WER (%) at the end of the budget; "
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
        *idle_lines(landscape_runs, arms, rows),
        *time_lines(landscape_runs),
        'The thresholds, as fixed before the runs (`studies/ablation/family.json`, "landscape"):',
        "",
        *(f"- `{row.comparison.arm}`: {landscape_rule(c, row.comparison.arm)[0]}" for row in rows),
        "",
        sensitivity_sentence(results, c, c.landscape_seeds, len(rows)),
        "",
    ]


def idle_lines(runs: Sequence[RunResult], arms: Dict[str, Arm], rows: Sequence[FamilyRow]) -> List[str]:
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
        said = f"{d.mean:+.2f}, {_plural(d.n, 'pair', 'pairs')}" if d.n else "no pair yet"
        head = (
            f"`{arm.name}` ({arm.label}) changed no gradient at any step of its {_plural(len(acting), 'run', 'runs')}: "
            "its row is no effect of the rule at this threshold. "
        )
        if arm.value("recurrent_grad_clip") > 0:
            tail = (
                "Its runs do `none`'s arithmetic in another order (with the cap in place the LSTM runs frame by "
                f"frame, not in PyTorch's fused kernel), so its difference from `none` ({said}) is what rounding "
                "alone did to the WER: a placebo."
            )
        else:
            tail = f"Its runs do `none`'s arithmetic, so its difference from `none` ({said}) measures no rule."
        lines += [head + tail, ""]
    return lines


def sensitivity_sentence(results: Sequence[RunResult], config: StudyConfig, pairs: int, m: int) -> str:
    """What a family of ``m`` comparisons at ``pairs`` pairs each can see: the standardised effect at which
    Holm's first step (alpha / m) reaches the planned power, and that effect in WER points at the spread of the
    round's ``filter`` − ``none`` on its condition (the most pairs this study has)."""
    effect = effect_for_power(pairs, config.alpha / m, config.power_target)
    text = (
        f"What {pairs} pairs can see: the paired t at {config.alpha:g} / {m} (Holm's first step) reaches power "
        f"{config.power_target:g} only at a standardised effect (mean over the standard deviation of the per-seed "
        f"differences) of at least {effect:.2f}"
    )
    reference = filter_effects(results, config, config.condition)
    sd = statistics.stdev(reference.values()) if len(reference) >= 2 else 0.0
    if sd == 0:
        return text + "."
    return (
        f"{text}: at the spread of `filter` − `none` on `{config.condition}` (standard deviation {sd:.2f} points "
        f"over its {len(reference)} pairs), about {effect * sd:.1f} points of WER. A smaller difference can sit "
        "inside a null here."
    )


def filter_effects(results: Sequence[RunResult], config: StudyConfig, condition: str) -> Dict[int, float]:
    """``{seed: filter - none}`` on the metric at ``condition``, per seed with both runs on one CPU."""
    runs = [r for r in results if r.key.condition == condition]
    pairing = pair_runs(
        [r for r in runs if r.key.arm == "filter"],
        [r for r in runs if r.key.arm == "none"],
        lambda r: r.wer.get(config.metric, math.nan),
    )
    return pairing.differences


def depth_interaction(deep: Dict[int, float], shallow: Dict[int, float], confidence: float) -> PairedDifference:
    """The filter's effect at the deep condition minus its effect at the shallow one (``{seed: filter -
    none}`` each, :func:`filter_effects`), over the seeds both have: mean and interval."""
    seeds = sorted(set(deep) & set(shallow))
    return paired_difference({k: deep[k] for k in seeds}, {k: shallow[k] for k in seeds}, confidence)


def learns_sentence(results: Sequence[RunResult], config: StudyConfig) -> str:
    """Whether the deep condition learns by family.json's bar: every arm's mean metric over its seeds at most
    ``depth_learns_at_most``; beside it, the highest run and the runs without a value (which do not learn)."""
    bar = config.depth_learns_at_most
    ended = [
        (r.wer.get(config.metric, math.nan), r.key.arm, r.key.seed)
        for r in results
        if r.key.condition == config.depth_condition
    ]
    by_arm: Dict[str, List[float]] = {}
    for wer, arm, _ in ended:
        by_arm.setdefault(arm, []).append(wer)
    means = {arm: statistics.mean(v) if all(math.isfinite(x) for x in v) else math.nan for arm, v in by_arm.items()}
    learns = all(m <= bar for m in means.values())
    planned = dict.fromkeys(x for c in config.depth_family for x in (c.baseline, c.arm))
    waiting = [arm for arm in planned if arm not in means]
    head = (
        f"Learns (every arm's mean {_wer_name(*config.metric)} WER at the end of the budget at most {bar:g}%, "
        f'`studies/ablation/family.json`, "depth"): '
    )
    if not means:
        return head + "not known yet (no run at the budget)."
    verdict = "no" if not learns else "yes" if not waiting else f"so far (no run yet of {', '.join(waiting)})"
    text = f"{head}{verdict}; per arm " + ", ".join(f"`{arm}` {m:.2f}" for arm, m in means.items())
    finite = [x for x in ended if math.isfinite(x[0])]
    if finite:
        worst, arm, seed = max(finite, key=lambda x: x[0])
        text += f"; the highest run {worst:.2f} (`{arm}`, seed {seed})"
    if len(finite) < len(ended):
        text += f"; {_plural(len(ended) - len(finite), 'run', 'runs')} without a value (not learning)"
    return text + "."


def interaction_sentence(results: Sequence[RunResult], config: StudyConfig) -> str:
    """The filter's effect at the deep condition minus its effect at the round's, with each depth's effect over
    the same seeds beside it (Student's t intervals, outside the families)."""
    deep = filter_effects(results, config, config.depth_condition)
    shallow = filter_effects(results, config, config.condition)
    d = depth_interaction(deep, shallow, config.confidence)
    text = (
        f"The filter's effect at `{config.depth_condition}` minus its effect at `{config.condition}` (each at its "
        f"condition's budget, {config.depth_budget.steps} and {config.steps} steps), over the {d.n} seed(s) both have"
    )
    if d.n < 2:
        return text + ": not computed (it needs 2)."
    seeds = sorted(set(deep) & set(shallow))
    ci = f"{100 * config.confidence:g}%"

    def over_seeds(effects: Dict[int, float]) -> PairedDifference:
        return paired_difference({k: effects[k] for k in seeds}, {k: 0.0 for k in seeds}, config.confidence)

    a, b = over_seeds(deep), over_seeds(shallow)
    return (
        f"{text} ({', '.join(str(k) for k in seeds)}): {d.mean:+.2f}, {ci} interval {d.interval(2)} (Student's t "
        f"over the seeds; outside the families). `filter` − `none` over those seeds, with {ci} intervals: "
        f"{a.mean:+.2f} {a.interval(2)} at `{config.depth_condition}`, {b.mean:+.2f} {b.interval(2)} at "
        f"`{config.condition}`."
    )


def depth_pilot_sentence(pilot: Optional[RunResult], config: StudyConfig) -> str:
    """The budget check of the deep condition (family.json's "depth" "pilot": the round's pilot rule), or how
    to make it."""
    head = f"Budget check at `{config.depth_condition}` (the round's pilot rule, family.json's \"depth\"): "
    if pilot is None:
        return head + "not made yet (`ablation.py --set depth --pilot only`, or before the set's next runs)."
    method, other = config.metric
    return (
        f"{head}`none` / seed {pilot.key.seed} trained to {pilot.steps} steps, {_wer_name(method, 'test-clean')} / "
        f"{_wer_name(method, other)} WER {pilot_points(pilot, config)}; {pilot_verdict(pilot, config)[1]}"
    )


def depth_section(
    results: Sequence[RunResult], labels: Dict[str, str], setup: ReportSetup, pilot: Optional[RunResult] = None
) -> List[str]:
    """The deep condition's budget check and family (family.json's "depth"), whether it learns, and the
    filter's interaction with depth, once the deep condition has runs."""
    c = setup.config
    waiting = [w for w in setup.waiting if w.startswith(f"{c.depth_condition}/")]
    if not any(r.key.condition == c.depth_condition for r in results) and pilot is None and not waiting:
        return []
    rows = family_rows(results, c, c.depth_condition, c.depth_family)
    return [
        f"### Depth: `{c.depth_condition}`",
        "",
        depth_pilot_sentence(pilot, c),
        "",
        *(
            [f"Waiting to train on (above): {_plural(len(waiting), 'run', 'runs')} of `{c.depth_condition}`.", ""]
            if waiting
            else []
        ),
        learns_sentence(results, c),
        "",
        f"Every arm minus `none` on `{c.depth_condition}`, seed by seed, on {_wer_name(*c.metric)} WER (%) at the end "
        f"of the budget; Holm over these {len(rows)} comparisons, apart from the other families "
        '(`studies/ablation/family.json`, "depth").',
        "",
        format_family_table(
            rows, labels, c, {arm: c.depth_seeds for x in c.depth_family for arm in (x.arm, x.baseline)}
        ),
        "",
        *time_lines([r for r in results if r.key.condition == c.depth_condition]),
        *([at_round_budget_sentence(results, c), ""] if c.depth_budget.steps != c.steps else []),
        sensitivity_sentence(results, c, c.depth_seeds, len(rows)),
        "",
        interaction_sentence(results, c),
        "",
    ]


def at_round_budget_sentence(results: Sequence[RunResult], config: StudyConfig) -> str:
    """The deep condition's family at the round's budget as well (its runs are decoded there too): whether the
    answer depends on the budget. Unadjusted intervals, beside the family."""
    step, ci = config.steps, f"{100 * config.confidence:g}%"
    deep = [r for r in results if r.key.condition == config.depth_condition]

    def of_arm(arm: str) -> List[RunResult]:
        return [r for r in deep if r.key.arm == arm]

    parts = []
    for comparison in config.depth_family:
        pairing = pair_runs(
            of_arm(comparison.arm),
            of_arm(comparison.baseline),
            lambda r: decoded(r).get(step, {}).get(config.metric, math.nan),
        )
        d = paired_difference(pairing.arm_values, pairing.baseline_values, config.confidence)
        mean = "-" if math.isnan(d.mean) else f"{d.mean:+.2f}"
        parts.append(f"`{comparison.arm}` − `{comparison.baseline}` {mean} {d.interval(2)} ({d.n} pairs)")
    end = config.depth_budget.steps
    changes = []
    for arm in dict.fromkeys(x for c in config.depth_family for x in (c.baseline, c.arm)):
        both = [decoded(r) for r in of_arm(arm)]
        moved = [d[end][config.metric] - d[step][config.metric] for d in both if step in d and end in d]
        if moved:
            changes.append(f"`{arm}` {statistics.mean(moved):+.2f} ({_plural(len(moved), 'seed', 'seeds')})")
    return (
        f"The same comparisons at the round's budget, {step} steps (every run here is decoded there too), "
        f"{_wer_name(*config.metric)}, with unadjusted {ci} intervals: "
        + "; ".join(parts)
        + ". Each arm's mean change from "
        + f"{step} to {end} steps (whether its seeds still improve): "
        + (", ".join(changes) if changes else "no run has both yet")
        + "."
    )


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


def family_runs(results: Sequence[RunResult], config: StudyConfig, condition: str) -> Dict[str, List[RunResult]]:
    """The runs of the family's arms on ``condition``, by arm (table order), the seeds each arm planned only."""
    planned = {arm: seeds_of(config.first_seed, n) for arm, n in config.seeds_per_arm.items()}
    return {
        arm: [r for r in runs if r.key.seed in planned[arm]]
        for (cond, arm), runs in group_runs(results).items()
        if cond == condition and arm in planned and any(r.key.seed in planned[arm] for r in runs)
    }


def arms_table(runs_of: Dict[str, List[RunResult]], arms: Dict[str, Arm], config: StudyConfig) -> str:
    """One row per arm: the primary metric at every decoding point, the step of leaving the loss plateau, how
    often the filter capped a sequence and the clip lowered the norm (mean ± sd over seeds), and the median
    clip scale; '-' where the arm has no such control."""
    method, test = config.metric
    points = sorted({step for runs in runs_of.values() for r in runs for step in decoded(r)})
    header = [
        "arm",
        "seeds",
        *[f"{_wer_name(method, test)} at {step}" for step in points],
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


def checked_replays(replays: Sequence[ReplayResult], originals: Dict[Tuple[str, int], RunResult]) -> List[ReplayResult]:
    """The replays whose branch (a) reproduces the run at every step of the window (checked)."""
    return [r for r in replays if (o := originals.get((r.key.condition, r.key.seed))) is not None and reproduces(r, o)]


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


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def wall_sentence(runs: Sequence[RunResult], replays: Sequence[ReplayResult]) -> str:
    """The wall time their summaries recorded (training and decoding; time paused inside a segment counts), in
    hours, and how many recorded none; empty when none did."""
    parts = []
    for what, items in (("runs", runs), ("replays", replays)):
        timed = [x.wall_total_s for x in items if x.wall_s]
        if timed:
            missing = len(items) - len(timed)
            parts.append(
                f"{sum(timed) / 3600:.2f} h for {_plural(len(timed), what[:-1], what)}"
                + (f" ({missing} recorded none)" if missing else "")
            )
    if not parts:
        return ""
    return f"Recorded wall time (training and decoding): {' and '.join(parts)}. "


def time_lines(runs: Sequence[RunResult]) -> List[str]:
    """A set's own paragraph of the wall and CPU time its runs recorded, then a blank line; none when they
    recorded no time."""
    text = (wall_sentence(runs, []) + cpu_sentence(runs)).strip()
    return [text, ""] if text else []


def cpu_sentence(runs: Sequence[RunResult]) -> str:
    """The CPU time of the runs whose summaries hold it in full (user + system of their training and
    decoding processes; replays record none), beside those runs' wall time; empty when none does."""
    counted = [(r.cpu_total_s, r.wall_total_s) for r in runs if r.cpu_total_s is not None]
    if not counted:
        return ""
    cpu, wall = (sum(x) for x in zip(*counted))
    others = len(runs) - len(counted)
    why = f" ({others} ran before it was recorded, or had a segment cut off)" if others else ""
    return (
        f"CPU time of the runs (user + system of their training and decoding processes), recorded in full for "
        f"{len(counted)} of {_plural(len(runs), 'run', 'runs')}{why}: {cpu / 3600:.2f} h in the "
        f"{wall / 3600:.2f} h of wall time those runs recorded. "
    )


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
            f"{_plural(ran, 'run', 'runs')} of round {setup.stored.get('round', '?')}, made before the family of "
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
            f"Of the {_plural(len(tested), 'comparison', 'comparisons')} with 2 pairs or more, "
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
            f"None of the {_plural(len(tested), 'comparison', 'comparisons')} with 2 pairs or more shows a "
            f"difference at family-wise {c.alpha:g} (smallest Holm p "
            f"{format_p(min(r.holm_p for r in tested))})."
        )
    now = power_now(rows, c)
    if now is not None:
        first = c.family[0]
        text += (
            f" `{first.arm}` − `{first.baseline}` has {now[0]} of its {c.seeds_per_arm.get(first.arm, 0)} planned "
            f"pairs: its power is {now[1]:.3f} at the effect the seeds were planned for (standardised "
            f"{c.planned_effect:+.3f}, alpha {c.alpha:g} / {len(c.family)}; planned: {c.power_target:g} at "
            f"{c.seeds_per_arm.get(first.arm, 0)} pairs), and the other comparisons have fewer planned pairs: a "
            "null at these pair counts does not show two arms equal."
        )
        text += planned_effect_sentence(rows[0], c, runs_of)
    return text


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
        return f"loss {loss:.4f}, {_wer_name(method, '/'.join(TEST_SETS))} {' / '.join(f'{w:.2f}' for w in wers)}"

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
        "### The answer",
        "",
        lead(rows, runs_of, replays, setup),
        "",
        f"The family ({_wer_name(*c.metric)} WER (%) at the end of the budget, arm minus baseline seed by seed; "
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
            f"{_wer_name(*c.metric)} WER (%); the step of leaving the plateau: counted from step 1, the first step "
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


def unadjusted_sentence(comparisons: Sequence[Comparison]) -> str:
    """How many of the described intervals leave out 0, beside how many would by chance if no arm differed."""
    intervals = [c.difference for c in comparisons if c.difference.n >= 2]
    outside = sum(1 for d in intervals if d.low > 0 or d.high < 0)
    return (
        f"{outside} of these {len(intervals)} unadjusted 95% intervals leave out 0, where about "
        f"{0.05 * len(intervals):.1f} would by chance alone if no arm differed from `none` (the intervals share "
        "runs, so they are not independent)."
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
        "### Replayed outlier events, with controls",
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


def pilot_verdict(pilot: RunResult, config: StudyConfig) -> Tuple[Optional[bool], str]:
    """Whether the pilot confirms the budget (family.json's rule): the primary metric moves by at most
    ``max_late_change`` from the budget to the pilot's end (flattened) and is at least ``min_metric_wer`` at
    the budget (not floored); None when the pilot lacks those decodings. With the sentence that says so, and
    test-clean at the budget beside it."""
    budget = config.budget_of(pilot.key.condition)
    p, steps = budget.pilot, budget.steps
    where = "depth.budget" if pilot.key.condition == config.depth_condition else "budget"
    method, other = config.metric
    clean = (method, "test-clean")
    if steps not in pilot.wer_at or p.steps not in pilot.wer_at:
        return None, f"the pilot was not decoded at {steps} and {p.steps} steps: the budget is not checked yet."
    late = pilot.wer_at[p.steps][config.metric] - pilot.wer_at[steps][config.metric]
    floor = pilot.wer_at[steps][config.metric]
    stands = abs(late) <= p.max_late_change and floor >= p.min_metric_wer
    text = (
        f"from {steps} to {p.steps} steps {other} moves {late:+.2f} (at most {p.max_late_change:g} "
        f"allowed) and is {floor:.2f} at {steps} (at least {p.min_metric_wer:g} required; test-clean "
        f"{pilot.wer_at[steps].get(clean, float('nan')):.2f}): "
        + (
            f"the budget of {steps} steps stands."
            if stands
            else f"the budget of {steps} steps does not stand by the rule; kept ({where}.kept): {budget.kept}"
            if budget.kept
            else f"the budget of {steps} steps does not stand: change {where}.steps in "
            "studies/ablation/family.json before the runs, and say why."
        )
    )
    return stands, text


def pilot_points(pilot: RunResult, config: StudyConfig) -> str:
    """The pilot's test-clean / primary-metric WER at each point it was decoded at."""
    clean = (config.metric[0], "test-clean")
    return "; ".join(
        f"{pilot.wer_at[s][clean]:.2f} / {pilot.wer_at[s][config.metric]:.2f} at {s}" for s in sorted(pilot.wer_at)
    )


def pilot_section(pilot: Optional[RunResult], config: StudyConfig) -> List[str]:
    if pilot is None:
        return []
    method, other = config.metric
    _, verdict_text = pilot_verdict(pilot, config)
    return [
        "### Pilot: the budget",
        "",
        f"`none` / seed {pilot.key.seed} trained to {pilot.steps} steps and decoded as every run, "
        f"{_wer_name(method, 'test-clean')} / {_wer_name(method, other)} WER: "
        + pilot_points(pilot, config)
        + f"; {verdict_text}",
        "",
    ]


def render_section(
    results: Sequence[RunResult],
    replays: Sequence[ReplayResult],
    arms: Dict[str, Arm],
    plots: Dict[str, Path],
    setup: ReportSetup,
    pilots: Sequence[RunResult] = (),
    observing_arm: str = "none",
) -> str:
    """The ablation section of RESULTS.md; ``pilots``: the budget checks made, of the round's condition and of
    the deep one."""
    labels = {name: f"`{name}`" for name in arms}
    pilot_of = {p.key.condition: p for p in pilots}
    conditions = [r.key.condition for r in results]
    condition = setup.config.condition if setup.config.condition in conditions else conditions[0]
    rows = family_rows(results, setup.config, condition)
    originals = {(r.key.condition, r.key.seed): r for r in results if r.key.arm == observing_arm}
    measures = control_measures(replays, originals, setup.methods)
    lines = [
        "## Ablation: GradientFilter, clip_grad_norm and the other gradient controls",
        "",
        f"Date: {setup.date}. Machine: {setup.machine}.",
        "",
        f"CPU models of the summaries: {_cpu_line(results, replays)}."
        + reproductions_sentence(setup.reproductions, setup.summaries),
        "",
        *(
            [
                "Trained to fewer steps than their condition's budget (steps made of the budget), left out of every "
                "table until they train on (their set's command resumes them from their last checkpoint): "
                + ", ".join(setup.waiting)
                + ".",
                "",
            ]
            if setup.waiting
            else []
        ),
        f"Command (from `egs/librispeech/ASR`, once its corpus is prepared: `make ablation` from the repository "
        f"root prepares it and runs this; the runs' summaries are in `{setup.summaries}/`):",
        "",
        "```bash",
        setup.command,
        "```",
        "",
        *answer_section(
            rows, family_runs(results, setup.config, condition), replays, measures, arms, labels, setup, originals
        ),
        *family_section(rows, setup, results, condition),
        *landscape_section(results, arms, setup),
        *depth_section(results, labels, setup, pilot_of.get(setup.config.depth_condition)),
        "### WER at each decoding point",
        "",
        format_wer_curves(results, arms, setup.methods),
        "",
        "### Set-up and every arm",
        "",
        *setup_text(setup, results, arms),
        "",
        column_notes(setup.thresholds.grad_filter_threshold, sorted({r.warm_end for r in results})),
        "",
        format_table(results, arms, setup.methods),
        "",
    ]
    for cond in dict.fromkeys(r.key.condition for r in results):
        observed = [r for r in results if r.key.condition == cond and r.key.arm == observing_arm]
        if not observed:
            continue
        thresholds = sorted({setup.thresholds.grad_filter_threshold, *setup.thresholds.filter_sweep})
        share = [100 * outlier_steps(r) for r in observed]
        lines += [
            f"### Where the outliers arise ({cond}, arm `{observing_arm}`: the filter observes only)",
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
    comparisons = paired_comparisons(results, setup.methods, observing_arm)
    lines += [
        "### Paired differences from `none`, described",
        "",
        "Every arm minus `none`, seed by seed (runs on two CPU models not paired): mean and 95% interval, for every "
        "WER and the validation loss. Descriptions, not tests (the tests are the family's): "
        + unadjusted_sentence(comparisons),
        "",
        format_comparisons(comparisons, arms),
        "",
        *replay_section(replays, measures, setup, originals),
        *pilot_section(pilot_of.get(setup.config.condition), setup.config),
        "### Plots",
        "",
        *[f"![{kind}]({p.name})" for kind, p in plots.items()],
        "",
        "<details><summary>Every command the ablation ran (from egs/librispeech/ASR)</summary>",
        "",
        "```bash",
        *[cmd for r in [*pilots, *results, *replays] for cmd in r.commands],
        "```",
        "",
        "</details>",
    ]
    return "\n".join(lines) + "\n"
