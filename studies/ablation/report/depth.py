"""The report's depth heading (the deep condition's budget check, whether it learns, its family and the
filter's interaction with depth) and the pilot that checks each condition's budget."""

from __future__ import annotations

import math
import re
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from studies.ablation.family import (
    StudyConfig,
    family_rows,
    format_family_table,
)
from studies.ablation.metrics import (
    decoded,
)
from studies.ablation.pairing import pair_runs
from studies.ablation.report.common import (
    ReportSetup,
    plural,
    time_lines,
    wer_name,
)
from studies.ablation.report.figures import (
    depth_interaction,
    filter_effects,
)
from studies.ablation.report.landscape import sensitivity_sentence
from studies.ablation.runs import RunResult
from studies.stats.paired import PairedDifference, paired_difference, welch_difference


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
        f"Learns (every arm's mean {wer_name(*config.metric)} WER at the end of the budget at most {bar:g}%, "
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
        text += f"; {plural(len(ended) - len(finite), 'run', 'runs')} without a value (not learning)"
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
        f"over the seeds; outside the families). `{config.family[0].arm}` − `{config.family[0].baseline}` over those "
        f"seeds, with {ci} intervals: "
        f"{a.mean:+.2f} {a.interval(2)} at `{config.depth_condition}`, {b.mean:+.2f} {b.interval(2)} at "
        f"`{config.condition}`." + interaction_caveats(results, config, deep, shallow, seeds)
    )


def interaction_caveats(
    results: Sequence[RunResult],
    config: StudyConfig,
    deep: Dict[int, float],
    shallow: Dict[int, float],
    seeds: Sequence[int],
) -> str:
    """What the interaction's shallow figure is (the shared seeds only, at the round's budget, against the
    deep one's at its own), the same with every shallow pair (unpaired: Welch), and both effects at the
    round's budget where the deep runs were decoded there."""
    ci = f"{100 * config.confidence:g}%"
    first = config.family[0]
    every = paired_difference(shallow, {k: 0.0 for k in shallow}, config.confidence)
    text = (
        f" The `{config.condition}` figure is the subset of {plural(len(seeds), 'seed', 'seeds')} at {config.steps} "
        f"steps; over all its {every.n} pairs `{first.arm}` − `{first.baseline}` is {every.mean:+.2f} "
        f"{every.interval(2)}, and the two effects are at different budgets ({config.depth_budget.steps} steps at "
        f"`{config.depth_condition}`)."
    )
    if len(deep) >= 2 and every.n >= 2:
        w = welch_difference(list(deep.values()), list(shallow.values()), config.confidence)
        text += (
            f" The interaction with all {every.n} `{config.condition}` pairs (unpaired: the mean of the "
            f"{len(deep)} deep effects minus the mean of the {every.n}, Welch's t): {w.mean:+.2f} {ci} interval "
            f"{w.interval(2)}."
        )
    at = {}
    for r in results:
        if r.key.condition == config.depth_condition and config.steps in r.wer_at:
            at[(r.key.arm, r.key.seed)] = r.wer_at[config.steps].get(config.metric, math.nan)
    deep_early = {
        s: at[(first.arm, s)] - at[(first.baseline, s)]
        for s in sorted(deep)
        if (first.arm, s) in at and (first.baseline, s) in at
    }
    same = sorted(set(deep_early) & set(shallow))
    if len(same) >= 2:
        d = paired_difference({k: deep_early[k] for k in same}, {k: shallow[k] for k in same}, config.confidence)
        text += (
            f" At one budget, {config.steps} steps for both, over the {plural(len(same), 'seed', 'seeds')} both "
            f"have: {d.mean:+.2f} {ci} interval {d.interval(2)} (Student's t over the seeds)."
        )
    return text


def budget_deviation_sentence(pilot: Optional[RunResult], config: StudyConfig) -> str:
    """The deep condition's budget as a deviation from the plan: moved after runs at the old budget were made
    (family.json's depth.budget.why names how many), and kept though its check failed; empty otherwise."""
    if pilot is None:
        return ""
    stands, _ = pilot_verdict(pilot, config)
    budget = config.depth_budget
    p = budget.pilot
    if stands is not False or not budget.kept:
        return ""
    late = pilot.wer_at[p.steps][config.metric] - pilot.wer_at[budget.steps][config.metric]
    why = config.raw.get("depth", {}).get("budget", {}).get("why", "")
    made = re.search(r"The (\d+) runs finished at ([\d,]+) steps", why)
    before = f" after {made.group(1)} depth runs had been trained and decoded at {made.group(2)} steps" if made else ""
    return (
        f"Deviations from the plan: the budget of `{config.depth_condition}` moved from {config.steps} to "
        f"{budget.steps} steps{before} (depth.budget.changed), and was then checked and kept although its rule "
        f"failed ({late:+.2f} against {p.max_late_change:g} allowed; depth.budget.kept)."
    )


def depth_pilot_sentence(pilot: Optional[RunResult], config: StudyConfig, results: Sequence[RunResult] = ()) -> str:
    """The budget check of the deep condition (family.json's "depth" "pilot": the round's pilot rule) and how
    many of its runs still improved before the budget, or how to make it."""
    head = f"Budget check at `{config.depth_condition}` (the round's pilot rule, family.json's \"depth\"): "
    if pilot is None:
        return head + "not made yet (`ablation.py --set depth --pilot only`, or before the set's next runs)."
    method, other = config.metric
    return (
        f"{head}`none` / seed {pilot.key.seed} trained to {pilot.steps} steps, {wer_name(method, 'test-clean')} / "
        f"{wer_name(method, other)} WER {pilot_points(pilot, config)}; {pilot_verdict(pilot, config)[1]}"
        + convergence_sentence(pilot, results, config, "stands" if pilot_verdict(pilot, config)[0] else "was kept")
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
        f"## Depth: `{c.depth_condition}`",
        "",
        depth_pilot_sentence(pilot, c, results),
        "",
        *([budget_deviation_sentence(pilot, c), ""] if budget_deviation_sentence(pilot, c) else []),
        *(
            [f"Waiting to train on (above): {plural(len(waiting), 'run', 'runs')} of `{c.depth_condition}`.", ""]
            if waiting
            else []
        ),
        learns_sentence(results, c),
        "",
        f"Every arm minus `none` on `{c.depth_condition}`, seed by seed, on {wer_name(*c.metric)} WER (%) at the end "
        f"of the budget; Holm over these {len(rows)} comparisons, apart from the other families "
        '(`studies/ablation/family.json`, "depth").',
        "",
        format_family_table(
            rows, labels, c, {arm: c.depth_seeds for x in c.depth_family for arm in (x.arm, x.baseline)}
        ),
        "",
        *time_lines([r for r in results if r.key.condition == c.depth_condition]),
        *([at_round_budget_sentence(results, c), ""] if c.depth_budget.steps != c.steps else []),
        sensitivity_sentence(rows, c, len(rows)),
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
            changes.append(f"`{arm}` {statistics.mean(moved):+.2f} ({plural(len(moved), 'seed', 'seeds')})")
    return (
        f"The same comparisons at the round's budget, {step} steps (every run here is decoded there too), "
        f"{wer_name(*config.metric)}, with unadjusted {ci} intervals: "
        + "; ".join(parts)
        + ". Each arm's mean change from "
        + f"{step} to {end} steps (whether its seeds still improve): "
        + (", ".join(changes) if changes else "no run has both yet")
        + "."
    )


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


def last_at_or_before(series: Sequence[Tuple[int, float]], step: int) -> float:
    """The last value of ``series`` at a step at or before ``step`` (nan when there is none)."""
    values = [v for s, v in series if s <= step]
    return values[-1] if values else math.nan


def still_improving(runs: Sequence[RunResult], metric: Tuple[str, str], early: int, late: int) -> Tuple[int, int, int]:
    """``(runs decoded at both steps, those whose metric fell from early to late, those whose validation loss
    at the last validation at or before late is below that at the last at or before early)``."""
    both = [r for r in runs if early in r.wer_at and late in r.wer_at]
    wer = sum(1 for r in both if r.wer_at[late].get(metric, math.nan) < r.wer_at[early].get(metric, math.nan))
    loss = sum(
        1
        for r in both
        if last_at_or_before(r.series("valid_loss"), late) < last_at_or_before(r.series("valid_loss"), early)
    )
    return len(both), wer, loss


def convergence_sentence(
    pilot: RunResult, results: Sequence[RunResult], config: StudyConfig, verdict: str = "stands"
) -> str:
    """What the budget's verdict (``"stands"``, or ``"was kept"`` where its rule failed) rests on: the pilot's one
    seed, beside how many of the condition's runs still improved over the last decoding interval before the
    budget; empty without such runs."""
    steps = config.budget_of(pilot.key.condition).steps
    runs = [r for r in results if r.key.condition == pilot.key.condition]
    points = sorted({s for r in runs for s in r.wer_at if s < steps})
    if not points or steps not in pilot.wer_at:
        return ""
    early = points[-1]
    n, wer, loss = still_improving(runs, config.metric, early, steps)
    if not n:
        return ""
    end = max(pilot.wer_at)
    late = pilot.wer_at[end][config.metric] - pilot.wer_at[steps][config.metric]
    return (
        f" The budget {verdict} on one seed's {late:+.2f} (the pilot, {steps} to {end} steps). Of the "
        f"{plural(n, 'run', 'runs')} of `{pilot.key.condition}` decoded at {early} and {steps} steps, {wer} still "
        f"improved {wer_name(*config.metric)} from {early} to {steps}, and the validation loss still fell in {loss} "
        f"(its last validation at or before {steps} below its last at or before {early})."
    )


def pilot_section(pilot: Optional[RunResult], config: StudyConfig, results: Sequence[RunResult] = ()) -> List[str]:
    if pilot is None:
        return []
    method, other = config.metric
    _, verdict_text = pilot_verdict(pilot, config)
    return [
        "## Pilot: the budget",
        "",
        f"`none` / seed {pilot.key.seed} trained to {pilot.steps} steps and decoded as every run, "
        f"{wer_name(method, 'test-clean')} / {wer_name(method, other)} WER: "
        + pilot_points(pilot, config)
        + f"; {verdict_text}"
        + convergence_sentence(pilot, results, config),
        "",
    ]
