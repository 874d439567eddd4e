"""The study proper (``family.json``, fixed after the pilot and before its runs): the arms on the pilot's cell,
each against the baseline seed by seed, and its report section. Without family.json there is no family yet.

family.json holds: ``fixed`` (date), ``cell`` (the pilot's pick), ``arms`` ({name: train.py's rule as
``none`` or ``<rule>=<value>``}), ``baseline``, ``comparisons`` ([[arm, baseline], ...], Holm over them),
``seeds``, ``steps``, ``decode`` (as pilot.json's; ``at``: a list, the last the endpoint), ``metric``,
``flag_at`` and the reasons for each; ``control`` (a dated amendment): the baseline arm on another ``cell``
with its own ``seeds``, the family's budget and decoding otherwise, to say whether the picked cell still
hurts the baseline at the endpoint.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scipy import stats

from studies.regime.grid import CELL_BY_NAME
from studies.regime.stage import HERE, Stage
from studies.stats.paired import (
    PairedDifference,
    holm_adjust,
    paired_difference,
    signed_rank_test,
    welch_difference,
)
from studies.stats.power import minimum_detectable_effect

FAMILY_FILE = HERE / "family.json"
DIVERGED_WER = 50.0  # pilot.json's "diverged", the family's too
MAX_SKIPPED = 0.10


def family_stage(path: Path = FAMILY_FILE) -> Optional[Stage]:
    """The family's stage, None before family.json is written."""
    if not path.is_file():
        return None
    design = json.loads(path.read_text())
    return Stage("family", design, (CELL_BY_NAME[design["cell"]],), tuple(design["arms"].items()))


def control_stage(path: Path = FAMILY_FILE) -> Optional[Stage]:
    """The control's stage (family.json's ``control``), None before it is written."""
    if not path.is_file():
        return None
    design = json.loads(path.read_text())
    control = design.get("control")
    if control is None:
        return None
    arm = control["arm"]
    return Stage("control", {**design, "seeds": control["seeds"]}, (CELL_BY_NAME[control["cell"]],), ((arm, arm),))


def diverged(summary: Dict) -> bool:
    """A run diverged: test-other WER at least 50% at the endpoint, or more than 10% of its steps skipped."""
    return summary["wer"]["test-other"] >= DIVERGED_WER or summary["skipped_steps"] > MAX_SKIPPED * summary["steps"]


def machine(summary: Dict) -> Tuple[str, ...]:
    """What a run's numbers depend on besides its flags (runs on two CPUs round differently)."""
    m = summary["machine"]
    return m["cpu_model"], m["cpu_flags"], m["threads"], m["torch"]


def same_machine_pairs(
    summaries: Dict[Tuple[str, str, int], Dict], arm: str, baseline: str, metric: str = "test-other"
) -> Tuple[Dict[int, float], Dict[int, float], int]:
    """``(arm's, baseline's {seed: endpoint WER})`` over the seeds whose two runs were made on one machine,
    and how many seeds with both runs were left out for being made on two."""
    runs = {(a, seed): s for (_, a, seed), s in summaries.items()}
    both = sorted({seed for a, seed in runs if a == arm} & {seed for a, seed in runs if a == baseline})
    kept = [seed for seed in both if machine(runs[(arm, seed)]) == machine(runs[(baseline, seed)])]
    wer = {a: {seed: runs[(a, seed)]["wer"][metric] for seed in kept} for a in (arm, baseline)}
    return wer[arm], wer[baseline], len(both) - len(kept)


@dataclass(frozen=True)
class Comparison:
    """``arm`` − ``baseline`` on endpoint test-other WER over the seeds whose two runs share a machine, Holm's p
    over the family, the exact signed-rank p, and each arm's runs and divergences with Fisher's exact p."""

    arm: str
    baseline: str
    difference: PairedDifference
    holm: float
    signed_rank: float
    left_out: int
    diverged: Tuple[int, int]
    runs: Tuple[int, int]
    fisher: float
    sd: float  # of the per-seed differences (nan under 2 pairs)


def per_seed_differences(arm: Dict[int, float], baseline: Dict[int, float]) -> Dict[int, float]:
    """``{seed: arm - baseline}``, rounded to 1e-6: the WERs have 2 decimals, so this drops only the float noise
    of the subtraction, and equal differences are equal (they tie in the signed-rank test, and a constant
    difference has no spread)."""
    return {s: round(arm[s] - baseline[s], 6) for s in sorted(set(arm) & set(baseline))}


def paired(differences: Dict[int, float]) -> PairedDifference:
    """The paired t statistics of ``{seed: difference}``; interval and p are nan under 2 pairs and where every
    difference is equal (no spread: the t-test is undefined there, and p 0 would claim what it cannot)."""
    d = paired_difference(differences, {s: 0.0 for s in differences})
    if d.n > 1 and statistics.stdev(differences.values()) == 0.0:
        return PairedDifference(d.mean, math.nan, math.nan, math.nan, d.n)
    return d


def comparisons(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> List[Comparison]:
    """family.json's comparisons, in its order. Holm counts every comparison of the family: one that cannot be
    tested enters with p 1 (family.json fixes the family's size, not the runs that happen to be in)."""
    pairs = [tuple(c) for c in stage.design["comparisons"]]
    matched = [same_machine_pairs(summaries, a, b) for a, b in pairs]
    per_seed = [per_seed_differences(x, y) for x, y, _ in matched]
    diffs = [paired(d) for d in per_seed]
    holm = holm_adjust([d.p if math.isfinite(d.p) else 1.0 for d in diffs])
    out = []
    for (a, b), (_, _, left_out), seeds, d, h in zip(pairs, matched, per_seed, diffs, holm):
        div = {arm: [diverged(s) for (_, x, _), s in summaries.items() if x == arm] for arm in (a, b)}
        table = [[sum(div[a]), len(div[a]) - sum(div[a])], [sum(div[b]), len(div[b]) - sum(div[b])]]
        fisher = stats.fisher_exact(table).pvalue if sum(div[a]) + sum(div[b]) > 0 else math.nan
        rank = signed_rank_test(list(seeds.values())).p
        counts = (sum(div[a]), sum(div[b])), (len(div[a]), len(div[b]))
        sd = statistics.stdev(seeds.values()) if len(seeds) > 1 else math.nan
        holm_p = h if math.isfinite(d.p) else math.nan
        out.append(Comparison(a, b, d, holm_p, rank, left_out, *counts, fisher, sd))
    return out


def comparison_rows(found: List[Comparison]) -> List[List[str]]:
    """One row per comparison (:func:`comparisons`)."""
    return [
        [
            f"`{c.arm}` − `{c.baseline}`",
            str(c.difference.n) + (f" ({c.left_out} left out: two machines)" if c.left_out else ""),
            f"{c.difference.mean:+.2f}" if c.difference.n else "-",
            c.difference.interval(2),
            _p(c.difference.p),
            _p(c.holm),
            _p(c.signed_rank),
            f"{c.diverged[0]}/{c.runs[0]} vs {c.diverged[1]}/{c.runs[1]}",
            _p(c.fisher),
        ]
        for c in found
    ]


def _p(p: float) -> str:
    return "-" if not math.isfinite(p) else f"{p:.3f}"


def arm_rows(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> List[List[str]]:
    """Per arm: runs, mean ± sd test-other and test-clean WER at each decoding point (the endpoint last), runs
    diverged, and the steps in which some sequence's gradient was above 25x its batch's median in some layer
    (where the soft filter at 25 scales it by 1/2 or less), with the largest such ratio."""
    rows = []
    for arm, spec in stage.arms:
        runs = [s for (_, a, _), s in summaries.items() if a == arm]
        if not runs:
            continue
        cells = []
        for point in stage.points:
            at = [r.get("wer_at", {}).get(str(point), r["wer"] if point == stage.points[-1] else None) for r in runs]
            other = [w["test-other"] for w in at if w is not None]
            cells.append(_mean_sd(other))
        clean = _mean_sd([r["wer"]["test-clean"] for r in runs])
        above = sum(r["max_over_median"]["steps_above_25"] for r in runs)
        steps = sum(r["max_over_median"]["steps"] for r in runs)
        ratio = max(r["max_over_median"]["max"] or 0.0 for r in runs)
        share = f"{100 * above / steps:.1f}% ({above} of {steps})" if steps else "-"
        rows.append(
            [f"`{arm}` ({spec})", str(len(runs)), *cells, clean, f"{sum(map(diverged, runs))}", share, f"{ratio:.0f}"]
        )
    return rows


def baseline_change(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> Optional[Tuple[int, float, float]]:
    """``(runs, mean test-other WER at the last-but-one decoding point, at the last)`` of the baseline; None
    before it has a run decoded at both or with one decoding point."""
    base = stage.design["baseline"]
    runs = [s for (_, a, _), s in summaries.items() if a == base and "wer_at" in s]
    if len(stage.points) < 2 or not runs:
        return None
    means = [statistics.fmean(r["wer_at"][str(p)]["test-other"] for r in runs) for p in stage.points[-2:]]
    return len(runs), means[0], means[1]


def learned(change: Tuple[int, float, float]) -> bool:
    """family.json's "learns": the baseline's mean endpoint test-other WER is below the divergence bound."""
    return change[2] < DIVERGED_WER


def flattened(stage: Stage, change: Tuple[int, float, float]) -> bool:
    """family.json's "converged": at most that many points of change between the last two decoding points."""
    return abs(change[2] - change[1]) <= stage.design["converged"]


def convergence_line(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> str:
    """Whether the baseline learns and has flattened: its mean test-other WER at the last two decoding points."""
    change = baseline_change(stage, summaries)
    if change is None:
        return ""
    runs, early_mean, late_mean = change
    early, late = stage.points[-2:]
    learns = "learns" if learned(change) else f"has not learned (at least {DIVERGED_WER:g}% at the end)"
    flat = "flattened" if flattened(stage, change) else "not flattened"
    converged = stage.design["converged"]
    return (
        f"`{stage.design['baseline']}` ({runs} run{'s' if runs != 1 else ''}): mean test-other WER {early_mean:.2f} "
        f"at {early} steps and {late_mean:.2f} at {late} ({late_mean - early_mean:+.2f}); it {learns} and is "
        f"{flat} by family.json's rule (at most {converged:g} point{'s' if converged != 1 else ''})."
    )


ALPHA = 0.05
POWER = 0.8


def answer(
    stage: Stage,
    summaries: Dict[Tuple[str, str, int], Dict],
    found: List[Comparison],
    control: Optional[Stage] = None,
    control_runs: Optional[Dict[Tuple[str, str, int], Dict]] = None,
) -> str:
    """The family's answer, once every run is in: per comparison what the paired test resolved (Holm at 0.05),
    the divergences, and the smallest effect it would find with 80% power from its own spread; said to be at
    a budget where the baseline had not learned or not flattened, where so; and what the control says of the
    premise that the cell hurts the baseline (open while its runs are not in). ``found``: :func:`comparisons`
    of the same runs."""
    total = len(stage.runs())
    if len(summaries) < total:
        return f"**The answer** is written here once all {total} runs are in."
    change = baseline_change(stage, summaries)
    alpha = ALPHA / len(found)
    sentences = [_comparison_sentence(c, alpha, stage.steps, len(found)) for c in found]
    head = "**The answer.**"
    base = f"`{stage.design['baseline']}`"
    if change is not None and not learned(change):
        head += f" At a budget where {base} had not learned (above):"
    elif change is not None and not flattened(stage, change):
        head += f" At a budget where {base} had not flattened (above):"
    return " ".join([head, *sentences, *_control_sentence(stage, summaries, control, control_runs or {})])


def _comparison_sentence(c: Comparison, alpha: float, steps: int, family: int) -> str:
    d, name = c.difference, f"`{c.arm}` against `{c.baseline}`"
    pairs = f"{d.n} seed pair{'s' if d.n != 1 else ''}"
    if c.left_out:
        pairs += f" ({c.left_out} left out: their two runs were made on two machines)"
    if d.n < 2:
        return f"{name}: {pairs}, too few to test."
    if not math.isfinite(d.p):
        return f"{name}: all {pairs} differ by {d.mean:+.2f} points; without spread, not tested."
    caveat = ""
    if c.holm < ALPHA:
        verb = "raised" if d.mean > 0 else "lowered"
        what = f"`{c.arm}` {verb} endpoint test-other WER against `{c.baseline}` by {abs(d.mean):.2f} points"
    elif d.low > 0 or d.high < 0:
        what = f"{name}: {d.mean:+.2f} points"
        caveat = ": its interval leaves out 0 before Holm's adjustment, not after"
    else:
        what = f"{name}: no difference resolved at {steps:,} steps, {d.mean:+.2f} points"
    what += f" {d.interval(2)} over {pairs} (Holm p {_p(c.holm)}){caveat}"
    mde = minimum_detectable_effect(c.sd, d.n, alpha, POWER)
    what += (
        f"; after the fact, at the observed sd {c.sd:.2f} of the differences and alpha {ALPHA:g} / {family}, "
        f"{POWER:.0%} power would need {mde:.2f} points"
    )
    if sum(c.diverged):
        what += (
            f"; diverged {c.diverged[0]} of {c.runs[0]} against {c.diverged[1]} of {c.runs[1]} "
            f"(Fisher p {_p(c.fisher)})"
        )
    else:
        what += "; no run of either diverged"
    return what + "."


@dataclass(frozen=True)
class ControlDifference:
    """The baseline on the picked cell minus the baseline on the control's cell (Welch), over the runs made on
    the machine of most of the family's baseline runs; the runs left out for another machine; divergences."""

    difference: PairedDifference
    runs: Tuple[int, int]
    left_out: int
    diverged: Tuple[int, int]


def control_difference(
    stage: Stage, summaries: Dict[Tuple[str, str, int], Dict], control_runs: Dict[Tuple[str, str, int], Dict]
) -> Optional[ControlDifference]:
    """None before the family's baseline and the control each have a run."""
    ours = [s for (_, a, _), s in summaries.items() if a == stage.design["baseline"]]
    theirs = list(control_runs.values())
    if not ours or not theirs:
        return None
    home = collections.Counter(machine(s) for s in ours).most_common(1)[0][0]
    kept = [[s for s in runs if machine(s) == home] for runs in (ours, theirs)]
    d = welch_difference(*([s["wer"]["test-other"] for s in runs] for runs in kept))
    left_out = len(ours) + len(theirs) - len(kept[0]) - len(kept[1])
    div = sum(map(diverged, kept[0])), sum(map(diverged, kept[1]))
    return ControlDifference(d, (len(kept[0]), len(kept[1])), left_out, div)


def _control_sentence(
    stage: Stage,
    summaries: Dict[Tuple[str, str, int], Dict],
    control: Optional[Stage],
    control_runs: Dict[Tuple[str, str, int], Dict],
) -> List[str]:
    if control is None:
        return []
    base, other = f"`{stage.design['baseline']}`", f"`{control.cells[0].name}`"
    total = len(control.runs())
    c = control_difference(stage, summaries, control_runs)
    if len(control_runs) < total or c is None or not math.isfinite(c.difference.low):
        return [
            f"Whether this cell still hurts {base} at this budget is open: the control ({base} on {other}) has "
            f"{len(control_runs)} of its {total} runs in{'' if c is None else f', {c.runs[1]} of them comparable'}."
        ]
    d = c.difference
    if d.low > 0:
        verdict = f"at this budget the cell still hurts {base}: "
    else:
        verdict = f"at this budget the control does not show the cell hurting {base}: "
    return [
        f"Against the control ({base} on {other}, descriptive, outside Holm), {verdict}{d.mean:+.2f} points "
        f"{d.interval(2)} (Welch, {c.runs[0]} against {c.runs[1]} runs)."
    ]


def control_line(
    stage: Stage,
    summaries: Dict[Tuple[str, str, int], Dict],
    control: Optional[Stage],
    control_runs: Dict[Tuple[str, str, int], Dict],
) -> str:
    """The baseline on the picked cell against the baseline on the control's cell (endpoint test-other WER,
    Welch, unpaired), over the runs made on the machine of most of the family's baseline runs."""
    if control is None:
        return ""
    base = stage.design["baseline"]
    cell, other = stage.cells[0].name, control.cells[0].name
    total = len(control.runs())
    head = (
        f"The control (family.json's amendment of {control.design['control']['amended'][:10]}): `{base}` on "
        f"`{cell}` minus `{base}` on `{other}`, endpoint test-other WER"
    )
    c = control_difference(stage, summaries, control_runs)
    if c is None:
        return f"{head}: {len(control_runs)} of {total} control runs in; it runs after the family."
    pending = f" ({len(control_runs)} of {total} control runs in)" if len(control_runs) < total else ""
    if not c.runs[0] or not c.runs[1]:
        return (
            f"{head}{pending}: no run of one side was made on the family's machine (runs made on another "
            f"machine, left out: {c.left_out})."
        )
    d = c.difference
    return (
        f"{head}{pending}: {d.mean:+.2f} {d.interval(2)} (Welch, {c.runs[0]} against {c.runs[1]} runs, p "
        f"{_p(d.p)}; runs made on another machine, left out: {c.left_out}); diverged {c.diverged[0]} of "
        f"{c.runs[0]} against {c.diverged[1]} of {c.runs[1]}."
    )


def _mean_sd(xs: List[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def family_section(
    stage: Optional[Stage],
    summaries: Dict[Tuple[str, str, int], Dict],
    control: Optional[Stage] = None,
    control_runs: Optional[Dict[Tuple[str, str, int], Dict]] = None,
) -> List[str]:
    """The family's report: its design, every arm at every decoding point, the control and the comparisons."""
    if stage is None:
        return []
    d = stage.design
    total = len(stage.runs())
    head = ["arm", "runs", *(f"test-other at {p}" for p in stage.points), "test-clean at the end", "diverged"]
    head += ["steps > 25x", "max seq/median"]
    comp = ["comparison", "pairs", "mean", "95% interval", "p", "Holm p", "signed-rank p", "diverged"]
    comp += ["Fisher p"]
    found = comparisons(stage, summaries)
    return [
        f"## The family: `{d['cell']}` (fixed {d['fixed']}, [family.json](family.json))",
        "",
        f"{len(summaries)} of {total} runs in. Each run {stage.steps} steps; greedy WER of icefall's model average "
        f"over the last {d['decode']['avg'] * d['decode']['save_every_n']} steps at each point; seeds "
        f"{stage.seeds[0]}-{stage.seeds[-1]}.",
        "",
        _table(head, arm_rows(stage, summaries)),
        "",
        "*steps > 25x*: steps in which some layer saw one sequence's gradient RMS above 25x its batch's median; "
        "*max seq/median*: the largest such ratio. The filter at 25 is soft: it scales every sequence's gradient "
        "by c / (c + n), n its RMS and c 25x the median: a factor of 1/2 at 25x, less above it, 25/26 at the "
        "median. In `filter-25` each layer sees the gradient the layers above it have already filtered, so its "
        "two columns are not comparable with the other arms'.",
        "",
        *_paragraphs(convergence_line(stage, summaries), control_line(stage, summaries, control, control_runs or {})),
        "Each arm minus the baseline, seed by seed, on greedy test-other WER (%) at the endpoint; Holm over the "
        f"{len(d['comparisons'])} comparisons; the exact signed-rank test beside it, not adjusted; diverged runs "
        "(test-other WER at least 50%, or more than 10% of the steps skipped) with Fisher's exact test.",
        "",
        _table(comp, comparison_rows(found)),
        "",
        _left_out_line(found),
        "",
        answer(stage, summaries, found, control, control_runs),
    ]


def _left_out_line(found: List[Comparison]) -> str:
    """How many seed pairs family.json's order would have paired but the machines kept apart, per comparison."""
    counts = ", ".join(f"{c.left_out} (`{c.arm}` − `{c.baseline}`)" for c in found)
    return f"Seed pairs left out because their two runs were made on two machines: {counts}."


def _paragraphs(*texts: str) -> List[str]:
    """Each non-empty text followed by a blank line."""
    return [line for text in texts if text for line in (text, "")]


def _table(head: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
