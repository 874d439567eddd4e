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
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scipy import stats

from studies.regime.grid import CELL_BY_NAME
from studies.regime.stage import HERE, Stage
from studies.stats.paired import (
    holm_adjust,
    paired_difference,
    seed_differences,
    signed_rank_test,
    welch_difference,
)

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


def comparison_rows(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> List[List[str]]:
    """One row per comparison: arm − baseline paired over the seeds whose two runs share a machine (mean, 95%
    interval, p, Holm's p over the family, the exact signed-rank p), and the runs diverged in each arm with
    Fisher's exact p."""
    comparisons = [tuple(c) for c in stage.design["comparisons"]]
    pairs = [same_machine_pairs(summaries, a, b) for a, b in comparisons]
    diffs = [paired_difference(x, y) for x, y, _ in pairs]
    holm = holm_adjust([d.p for d in diffs])
    rows = []
    for (a, b), (x, y, left_out), d, h in zip(comparisons, pairs, diffs, holm):
        rank = signed_rank_test(seed_differences(x, y))
        div = {arm: [diverged(s) for (_, x, _), s in summaries.items() if x == arm] for arm in (a, b)}
        table = [[sum(div[a]), len(div[a]) - sum(div[a])], [sum(div[b]), len(div[b]) - sum(div[b])]]
        fisher = stats.fisher_exact(table).pvalue if sum(div[a]) + sum(div[b]) > 0 else math.nan
        rows.append(
            [
                f"`{a}` − `{b}`",
                str(d.n) + (f" ({left_out} left out: two machines)" if left_out else ""),
                f"{d.mean:+.2f}" if d.n else "-",
                d.interval(2),
                _p(d.p),
                _p(h),
                _p(rank.p),
                f"{sum(div[a])}/{len(div[a])} vs {sum(div[b])}/{len(div[b])}",
                _p(fisher),
            ]
        )
    return rows


def _p(p: float) -> str:
    return "-" if not math.isfinite(p) else f"{p:.3f}"


def arm_rows(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> List[List[str]]:
    """Per arm: runs, mean ± sd test-other and test-clean WER at each decoding point (the endpoint last)."""
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
        rows.append([f"`{arm}` ({spec})", str(len(runs)), *cells, clean, f"{sum(map(diverged, runs))}"])
    return rows


def convergence_line(stage: Stage, summaries: Dict[Tuple[str, str, int], Dict]) -> str:
    """Whether the baseline learns and has flattened: its mean test-other WER at the last two decoding points
    (family.json's "converged": at most that many points of change between them)."""
    base = stage.design["baseline"]
    runs = [s for (_, a, _), s in summaries.items() if a == base and "wer_at" in s]
    if len(stage.points) < 2 or not runs:
        return ""
    early, late = stage.points[-2], stage.points[-1]
    mean = {p: statistics.fmean(r["wer_at"][str(p)]["test-other"] for r in runs) for p in (early, late)}
    change = mean[late] - mean[early]
    verdict = "flattened" if abs(change) <= stage.design["converged"] else "not flattened"
    return (
        f"`{base}` ({len(runs)} runs): mean test-other WER {mean[early]:.2f} at {early} steps and {mean[late]:.2f} "
        f"at {late} ({change:+.2f}; {verdict} by family.json's rule, at most {stage.design['converged']:g} points)."
    )


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
    ours = [s for (_, a, _), s in summaries.items() if a == base]
    theirs = list(control_runs.values())
    head = (
        f"The control (family.json's amendment of {control.design['control']['amended'][:10]}): `{base}` on "
        f"`{cell}` minus `{base}` on `{other}`, endpoint test-other WER"
    )
    if not ours or not theirs:
        return f"{head}: {len(theirs)} of {len(control.runs())} control runs in; it runs after the family."
    home = collections.Counter(machine(s) for s in ours).most_common(1)[0][0]
    kept = {name: [s for s in runs if machine(s) == home] for name, runs in (("ours", ours), ("theirs", theirs))}
    left_out = len(ours) + len(theirs) - len(kept["ours"]) - len(kept["theirs"])
    d = welch_difference(
        [s["wer"]["test-other"] for s in kept["ours"]], [s["wer"]["test-other"] for s in kept["theirs"]]
    )
    div = {name: sum(map(diverged, runs)) for name, runs in kept.items()}
    return (
        f"{head}: {d.mean:+.2f} {d.interval(2)} (Welch, {len(kept['ours'])} against {len(kept['theirs'])} runs, "
        f"p {_p(d.p)}; runs made on another machine, left out: {left_out}); diverged {div['ours']} of "
        f"{len(kept['ours'])} against {div['theirs']} of {len(kept['theirs'])}."
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
    comp = ["comparison", "pairs", "mean", "95% interval", "p", "Holm p", "signed-rank p", "diverged"]
    comp += ["Fisher p"]
    return [
        f"## The family: `{d['cell']}` (fixed {d['fixed']}, [family.json](family.json))",
        "",
        f"{len(summaries)} of {total} runs in. Each run {stage.steps} steps; greedy WER of icefall's model average "
        f"over the last {d['decode']['avg'] * d['decode']['save_every_n']} steps at each point; seeds "
        f"{stage.seeds[0]}-{stage.seeds[-1]}.",
        "",
        _table(head, arm_rows(stage, summaries)),
        "",
        *_paragraphs(convergence_line(stage, summaries), control_line(stage, summaries, control, control_runs or {})),
        "Each arm minus the baseline, seed by seed, on greedy test-other WER (%) at the endpoint; Holm over the "
        f"{len(d['comparisons'])} comparisons; the exact signed-rank test beside it, not adjusted; diverged runs "
        "(test-other WER at least 50%, or more than 10% of the steps skipped) with Fisher's exact test.",
        "",
        _table(comp, comparison_rows(stage, summaries)),
    ]


def _paragraphs(*texts: str) -> List[str]:
    """Each non-empty text followed by a blank line."""
    return [line for text in texts if text for line in (text, "")]


def _table(head: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
