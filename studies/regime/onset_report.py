"""The onset study's report section (the top of this folder's README.md) and its plots: each question's answer
first, what prompted it, its tables, the learning curves of its four arms, and where its runs were made."""

from __future__ import annotations

import collections
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from studies.regime.family import diverged, paired, per_seed_differences  # noqa: E402
from studies.regime.onset import (  # noqa: E402
    MACHINES_FILE,
    QUESTIONS,
    Summaries,
    alike,
    comparable,
    gate_passed,
    gate_runs,
    machine_name,
    question_stage,
)
from studies.regime.onset_stats import (  # noqa: E402
    Exit,
    Median,
    fisher,
    hazard_ratio,
    km_median,
    logrank,
    plateau_exit,
)
from studies.regime.stage import HERE, WINDOW, Stage  # noqa: E402
from studies.stats.paired import PairedDifference, holm_adjust, signed_rank_test  # noqa: E402

PLOTS = HERE / "plots"
ALPHA = 0.05
COLORS = {"none": "black", "filter-25": "tab:blue", "guard": "tab:orange", "zclip": "tab:green"}


# --------------------------------------------------------------------------
# The numbers
# --------------------------------------------------------------------------


def arm_runs(summaries: Summaries, arm: str) -> Dict[int, Dict]:
    """``{seed: summary}`` of one arm."""
    return {seed: s for (_, a, seed), s in sorted(summaries.items()) if a == arm}


def exits(stage: Stage, runs: Dict[int, Dict]) -> Dict[int, Exit]:
    """``{seed: plateau exit}`` by the design's rule, censored at its budget."""
    rule = stage.design["plateau"]
    return {seed: plateau_exit(s["loss_per_50_steps"], rule, stage.steps) for seed, s in runs.items()}


def wer_at(summary: Dict, point: int) -> float:
    """Greedy test-other WER at decoding point ``point``; ValueError naming the run where it was not decoded
    there (the endpoint's WER stands in for no other point). A stage that decodes once, at its budget, writes no
    ``wer_at`` (stage.summarise): its summary's ``wer`` is that decoding."""
    if "wer_at" not in summary and point == summary["steps"]:
        return summary["wer"]["test-other"]
    wer = summary.get("wer_at", {}).get(str(point))
    if wer is None:
        key = summary["key"]
        raise ValueError(
            f"{key['cell']}/{key['arm']}/seed-{key['seed']} has no decoding at step {point} "
            f"(decoded at {sorted(summary.get('wer_at', {}), key=int)}): rerun its decodings"
        )
    return wer["test-other"]


@dataclass(frozen=True)
class ExitRow:
    """One arm's plateau exits and, against the baseline, the Cox hazard ratio, log-rank p and Holm p."""

    arm: str
    exits: Dict[int, Exit]
    median: Median
    hazard: Tuple[float, float, float]
    p: float
    holm: float


def exit_rows(stage: Stage, summaries: Summaries) -> List[ExitRow]:
    """The baseline's row, then one per comparison (Holm over the design's comparisons; an untestable one enters
    with p 1, as the family's do)."""
    base = stage.design["baseline"]
    by_arm = {arm: exits(stage, arm_runs(summaries, arm)) for arm, _ in stage.arms}
    tests = []
    for arm, _ in stage.design["comparisons"]:
        a, b = list(by_arm[arm].values()), list(by_arm[base].values())
        tests.append((hazard_ratio(a, b), logrank(a, b) if a and b else math.nan))
    holm = holm_adjust([p if math.isfinite(p) else 1.0 for _, p in tests])
    nan3 = (math.nan, math.nan, math.nan)
    rows = [ExitRow(base, by_arm[base], km_median(list(by_arm[base].values())), nan3, math.nan, math.nan)]
    for (arm, _), (hr, p), h in zip(stage.design["comparisons"], tests, holm):
        e = by_arm[arm]
        rows.append(ExitRow(arm, e, km_median(list(e.values())), hr, p, h if math.isfinite(p) else math.nan))
    return rows


@dataclass(frozen=True)
class WerComparison:
    """``arm`` − baseline on test-other WER at one decoding point over the seeds both have: the paired t
    interval, Holm over the design's comparisons at that point, the exact signed-rank p."""

    arm: str
    difference: PairedDifference
    holm: float
    signed_rank: float


def wer_comparisons(stage: Stage, summaries: Summaries, point: int) -> List[WerComparison]:
    base = arm_runs(summaries, stage.design["baseline"])
    diffs = []
    for arm, _ in stage.design["comparisons"]:
        mine = arm_runs(summaries, arm)
        diffs.append(
            (
                arm,
                per_seed_differences(
                    {s: wer_at(r, point) for s, r in mine.items()}, {s: wer_at(r, point) for s, r in base.items()}
                ),
            )
        )
    found = [paired(d) for _, d in diffs]
    holm = holm_adjust([d.p if math.isfinite(d.p) else 1.0 for d in found])
    return [
        WerComparison(arm, d, h if math.isfinite(d.p) else math.nan, signed_rank_test(list(x.values())).p)
        for (arm, x), d, h in zip(diffs, found, holm)
    ]


def above(runs: Dict[int, Dict], point: int, bound: float = 50.0) -> int:
    """Runs at or above ``bound`` % test-other WER at ``point``."""
    return sum(wer_at(s, point) >= bound for s in runs.values())


# --------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------


def _p(p: float) -> str:
    return "-" if not math.isfinite(p) else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _hr(h: Tuple[float, float, float]) -> str:
    if math.isnan(h[0]):
        return "-"
    if math.isnan(h[1]):  # complete separation: the Cox likelihood has no maximum
        if h[0] > 1:
            return "∞ (no baseline run left the plateau while a run of the arm was still on it)"
        return "0 (no run of the arm left the plateau while a baseline run was still on it)"
    return f"{h[0]:.2f} [{h[1]:.2f}, {h[2]:.2f}]"


def _step(m: Median, budget: int) -> str:
    if m.step is None:
        return f"not reached by {budget:,}"
    if m.at_least:
        return f"{m.step:,.0f} or later (half still on the plateau at {budget:,})"
    return f"{m.step:,.0f}"


def _exit(e: Exit) -> str:
    return f"{e.step}" if e.observed else f">{e.step}"


def _mean_sd(xs: Sequence[float]) -> str:
    if not xs:
        return "-"
    return f"{xs[0]:.2f}" if len(xs) == 1 else f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def _diff(c: WerComparison) -> str:
    d = c.difference
    return "-" if not d.n else f"{d.mean:+.2f} {d.interval(2)}"


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _verdict(row: ExitRow) -> str:
    """confirmed / refuted / not resolved, by Holm p at 0.05 and the hazard ratio's side of 1."""
    if not math.isfinite(row.holm) or row.holm >= ALPHA:
        return "not resolved"
    return "confirmed" if row.hazard[0] > 1 else "refuted"


# --------------------------------------------------------------------------
# slow-start
# --------------------------------------------------------------------------


def prompted_by(family: Optional[Stage], family_runs: Summaries, rule: Dict, budget: int) -> List[str]:
    """The exploratory numbers that prompted slow-start, recomputed from the family's summaries with this
    question's rule: runs at >= 50% WER at 900 steps, arm − none at 900 (paired t, Holm over three), the
    signed-rank p, the median plateau exit."""
    if family is None or not family_runs:
        return []
    point = 900
    exploratory = Stage(family.name, {**family.design, "plateau": rule, "steps": budget}, family.cells, family.arms)
    rows_exit = {r.arm: r for r in exit_rows(exploratory, family_runs)}
    comps = {c.arm: c for c in wer_comparisons(family, family_runs, point)}
    rows = []
    for arm, _ in family.arms:
        runs = arm_runs(family_runs, arm)
        c = comps.get(arm)
        rows.append(
            [
                f"`{arm}`",
                f"{above(runs, point)} of {len(runs)}",
                "" if c is None else _diff(c),
                "" if c is None else _p(c.holm),
                "" if c is None else _p(c.signed_rank),
                _step(rows_exit[arm].median, budget),
            ]
        )
    head = ["arm", ">= 50% WER at 900", "arm − none at 900, 95% interval", "Holm p", "signed-rank p", "median exit"]
    return [
        f"*What prompted it* (exploratory: the family's runs on `{family.cells[0].name}`, seeds "
        f"{family.seeds[0]}-{family.seeds[-1]}, found by looking, not counted in the answer; recomputed here from "
        "their summaries):",
        "",
        *_table(head, rows),
        "",
    ]


def slow_start_answer(stage: Stage, kept: Summaries, rows: List[ExitRow]) -> str:
    total = len(stage.runs())
    if len(kept) < total:
        return f"**The answer** is written here once all {total} runs are in ({len(kept)} in)."
    base = rows[0]
    parts = []
    for row in rows[1:]:
        parts.append(
            f"`{row.arm}`: {_verdict(row)}, hazard ratio of leaving the plateau {_hr(row.hazard)} against "
            f"`{base.arm}` (log-rank Holm p {_p(row.holm)}); median exit {_step(row.median, stage.steps)} "
            f"against {_step(base.median, stage.steps)} steps"
        )
    return (
        f"**The answer** ({len(kept)} runs, {stage.steps:,} steps; confirmed: Holm p < {ALPHA} with a hazard "
        "ratio above 1, i.e. the arm leaves the plateau sooner; the ratio's 95% interval is Cox's Wald interval, "
        "not adjusted for the three comparisons, and is not the test): " + "; ".join(parts) + "."
    )


def slow_start_section(stage: Stage, summaries: Summaries, family: Optional[Stage], family_runs: Summaries) -> List:
    kept, left_out = comparable(stage, summaries)
    rows = exit_rows(stage, kept)
    d = stage.design
    points = stage.points
    seeds = stage.seeds
    head = ["arm", *(f"seed {s}" for s in seeds), "median exit (KM)", f"on the plateau at {stage.steps:,}"]
    head += ["hazard ratio vs none, 95% interval", "log-rank p", "Holm p"]
    primary = [
        [
            f"`{r.arm}`",
            *(_exit(r.exits[s]) if s in r.exits else "" for s in seeds),
            _step(r.median, stage.steps),
            f"{sum(not e.observed for e in r.exits.values())} of {len(r.exits)}",
            _hr(r.hazard),
            _p(r.p),
            _p(r.holm),
        ]
        for r in rows
    ]
    comps = {p: {c.arm: c for c in wer_comparisons(stage, kept, p)} for p in points}
    base_runs = arm_runs(kept, d["baseline"])
    secondary = []
    for arm, _ in stage.arms:
        runs = arm_runs(kept, arm)
        row = [f"`{arm}`"]
        for p in points:
            c = comps[p].get(arm)
            row += [_mean_sd([wer_at(s, p) for s in runs.values()])]
            row += ["" if c is None else f"{_diff(c)} (Holm p {_p(c.holm)}, signed-rank p {_p(c.signed_rank)})"]
        fisher_p = fisher((above(runs, points[0]), len(runs)), (above(base_runs, points[0]), len(base_runs)))
        row += [f"{above(runs, points[0])} of {len(runs)}", "" if arm == d["baseline"] else _p(fisher_p)]
        secondary.append(row)
    head2 = ["arm"]
    for p in points:
        head2 += [f"test-other at {p:,}", f"arm − none at {p:,}, 95% interval"]
    head2 += [f">= 50% at {points[0]:,}", "Fisher p"]
    rule = d["plateau"]
    return [
        f"### 1. {d['question']} (`{d['cell']}`, {stage.steps:,} steps)",
        "",
        slow_start_answer(stage, kept, rows),
        "",
        *prompted_by(family, family_runs, rule, stage.steps),
        f"**Plateau exit** (primary): the last step of the first 50-step window from step {rule['from_step']} on "
        f"whose mean training loss is below {rule['level']:.2f}; `>{stage.steps}`: still on the plateau at the "
        "budget (censored). Log-rank test (statsmodels) against `none`, Holm over the three; the Cox hazard ratio "
        "of leaving the plateau (above 1: sooner than `none`; Breslow's ties) with its Wald 95% interval, not "
        "adjusted; Kaplan-Meier medians (R survival's convention: where the curve sits at one half up to a later "
        "exit, the midpoint of that stretch; without censoring, the sample median; where it sits there up to the "
        f"budget, that step or later). Power planned in onset.json: {d['power']}",
        "",
        *_table(head, primary),
        "",
        "Secondary: greedy test-other WER (%) of the model averaged over the last 300 steps; each arm − `none` "
        "paired by seed (t interval, Holm over the three at each point; exact signed-rank p, not adjusted); runs "
        f"at or above 50% at {points[0]:,} steps with Fisher's exact test, not adjusted.",
        "",
        *_table(head2, secondary),
        "",
        *_curves_and_provenance(stage, summaries, left_out),
    ]


# --------------------------------------------------------------------------
# rescue
# --------------------------------------------------------------------------


def rescue_answer(stage: Stage, kept: Summaries, rows: List[Tuple[str, int, int, float, float]]) -> str:
    d = stage.design
    base = d["baseline"]
    gate = gate_passed(stage, kept)
    gate_in = sum((r.cell.name, r.arm, r.seed) in kept for r in gate_runs(stage))
    collapsed = sum(diverged(s) for s in arm_runs(kept, base).values())
    if gate is None:
        return (
            f"**The gate**: {gate_in} of {len(gate_runs(stage))} `{base}` runs in, {collapsed} collapsed; the other "
            f"arms run once all are in and at least {d['gate_min_collapsed']} collapsed."
        )
    if not gate:
        return (
            f"**The answer.** `{base}` collapsed in {collapsed} of {gate_in} runs at {stage.steps:,} steps, fewer "
            f"than the {d['gate_min_collapsed']} onset.json asked for: training without control collapsed in at "
            "most half of its runs here, so by the gate the other arms were not run and the question stops here."
        )
    total = len(stage.runs())
    if len(kept) < total:
        return (
            f"The gate passed (`{base}` collapsed in {collapsed} of {gate_in}). **The answer** is written here once "
            f"all {total} runs are in ({len(kept)} in)."
        )
    parts = []
    for arm, k, n, p, h in rows[1:]:
        verdict = "not resolved" if not math.isfinite(h) or h >= ALPHA else "confirmed" if k < collapsed else "refuted"
        parts.append(f"`{arm}`: {verdict}, collapsed {k} of {n} against {collapsed} (Fisher p {_p(p)}, Holm p {_p(h)})")
    return (
        f"**The answer** ({len(kept)} runs, {stage.steps:,} steps; confirmed: Holm p < {ALPHA} with fewer "
        f"collapses than `{base}`): " + "; ".join(parts) + "."
    )


def rescue_section(stage: Stage, summaries: Summaries) -> List[str]:
    kept, left_out = comparable(stage, summaries)
    d = stage.design
    base = arm_runs(kept, d["baseline"])
    base_k = sum(map(diverged, base.values()))
    counts = []
    for arm, _ in stage.arms:
        runs = arm_runs(kept, arm)
        k = sum(map(diverged, runs.values()))
        counts.append((arm, k, len(runs), fisher((k, len(runs)), (base_k, len(base))) if arm != d["baseline"] else 0))
    holm = holm_adjust([p if math.isfinite(p) else 1.0 for _, _, _, p in counts[1:]])
    rows = [(counts[0][0], counts[0][1], counts[0][2], math.nan, math.nan)]
    rows += [(a, k, n, p, h if math.isfinite(p) and n else math.nan) for (a, k, n, p), h in zip(counts[1:], holm)]
    ex = {r.arm: r for r in exit_rows(stage, kept)}
    end = stage.points[-1]
    base_wer = {seed: wer_at(s, end) for seed, s in base.items()}
    table = []
    for arm, k, n, p, h in rows:
        runs = arm_runs(kept, arm)
        wers = [wer_at(s, end) for s in runs.values()]
        spread = f"{statistics.median(wers):.2f} ({min(wers):.2f}-{max(wers):.2f})" if wers else "-"
        diffs = per_seed_differences({seed: wer_at(s, end) for seed, s in runs.items()}, base_wer)
        by_seed = "-"
        if arm != d["baseline"] and diffs:
            x = list(diffs.values())
            test = signed_rank_test(x)
            by_seed = f"{statistics.median(x):+.2f} ({len(x)} seeds, {test.n} non-zero; p {_p(test.p)})"
        e = ex[arm]
        table.append(
            [
                f"`{arm}`",
                f"{k} of {n}" if n else "-",
                _p(p),
                _p(h),
                spread,
                by_seed,
                _step(e.median, stage.steps) if n else "-",
                f"{sum(not x.observed for x in e.exits.values())} of {n}" if n else "-",
                _p(e.p),
            ]
        )
    amended = d["collapse_amended"]
    head = ["arm", "collapsed", "Fisher p", "Holm p", f"test-other at {end:,}: median (range)"]
    head += [f"arm − none at {end:,} by seed: median, signed-rank p", "median exit"]
    head += [f"on the plateau at {stage.steps:,}", "log-rank p"]
    return [
        f"### 2. {d['question']} (`{d['cell']}`, {stage.steps:,} steps)",
        "",
        rescue_answer(stage, kept, rows),
        "",
        f"*What prompted it*: {d['cell_why']} {d['steps_why']}",
        "",
        f"**Collapse** (primary): {amended['collapse']} (Wording amended {amended['date'][:10]} before any run of "
        f"this question: {amended['why']}) Each arm against `{d['baseline']}` by Fisher's exact test, Holm "
        "over the three. Secondary, not adjusted: test-other WER at the budget (each arm − `none` paired by seed, "
        "the exact signed-rank test), and the plateau exit as question 1 defines it with its log-rank test.",
        "",
        *_table(head, table),
        "",
        *_curves_and_provenance(stage, summaries, left_out),
    ]


def _curves_and_provenance(stage: Stage, summaries: Summaries, left_out: int) -> List[str]:
    """A question's plot and where its runs were made."""
    return [
        f"![training loss by step, median and interquartile range over seeds](plots/onset-{stage.name}.png)",
        "",
        provenance_line(stage, summaries, left_out),
        "",
    ]


def provenance_line(stage: Stage, summaries: Summaries, left_out: int) -> str:
    """Where and with which code the question's runs were made."""
    if not summaries:
        return "No run yet."
    machines = collections.Counter(machine_name(s["machine"]) for s in summaries.values())
    commits = collections.Counter(s.get("commit", "unknown")[:12] for s in summaries.values())
    where = "; ".join(f"{n} on {m}" for m, n in machines.items())
    code = ", ".join(f"{c} ({n})" for c, n in commits.items())
    shown = "".join(
        f" {r['machine']} {'was' if r['alike'] else 'was not'} shown to compute as {r['of']} on {r['date']}: "
        f"{r['steps']} steps of {r['run']} retrained there, their training losses' digest "
        f"{'equal to' if r['alike'] else 'unlike'} the run's (summaries/{stage.name}/{MACHINES_FILE})."
        for r in alike(stage)
    )
    return (
        f"Runs: {where}; left out of the tests for another machine: {left_out}.{shown} Code commit: {code}. "
        "Commands of each run: its summary in summaries/" + stage.name + "/."
    )


# --------------------------------------------------------------------------
# The section and the plots
# --------------------------------------------------------------------------


def onset_section(design: Optional[Dict], family: Optional[Stage], family_runs: Summaries) -> List[str]:
    """Both questions, each answer first; empty before onset.json is written."""
    if design is None:
        return []
    slow, rescue = (question_stage(q, design) for q in QUESTIONS)
    return [
        f"## Two confirmatory questions (fixed {design['fixed']} before their runs: [onset.json](onset.json))",
        "",
        f"Order (amended {design['order_amended']['date'][:10]} before any run finished): "
        f"{design['order_amended']['order']} Machines: {design['machine']}",
        "",
        *slow_start_section(slow, slow.load_summaries(), family, family_runs),
        *rescue_section(rescue, rescue.load_summaries()),
    ]


def plot_curves(stage: Stage, summaries: Summaries, path: Path) -> Path:
    """Training loss by step (the 50-step windows up to the budget) of each arm: the median over its seeds and
    the interquartile range; the plateau rule's level dashed."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    full = stage.steps // WINDOW
    x = [WINDOW * (i + 1) for i in range(full)]
    for arm, _ in stage.arms:
        runs = arm_runs(summaries, arm)
        if not runs:
            continue
        y = np.array([[np.nan if v is None else v for v in s["loss_per_50_steps"][:full]] for s in runs.values()])
        q1, med, q3 = np.nanpercentile(y, [25, 50, 75], axis=0)
        color = COLORS.get(arm)
        ax.plot(x[: len(med)], med, color=color, label=f"{arm} ({len(runs)} runs)")
        ax.fill_between(x[: len(med)], q1, q3, color=color, alpha=0.15, linewidth=0)
    rule = stage.design["plateau"]
    ax.axhline(rule["level"], color="grey", linestyle="--", linewidth=0.8, label=f"plateau exit level {rule['level']}")
    ax.set_xlabel("step (end of a 50-step window)")
    ax.set_ylabel("training loss (window mean)")
    ax.set_title(f"{stage.name}: {stage.cells[0].name}, median and interquartile range over seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_plots(design: Optional[Dict]) -> List[Path]:
    """One plot per question with a run (plots/onset-<question>.png)."""
    if design is None:
        return []
    out = []
    for name in QUESTIONS:
        stage = question_stage(name, design)
        runs = stage.load_summaries()
        if runs:
            out.append(plot_curves(stage, runs, PLOTS / f"onset-{name}.png"))
    return out
