"""The study proper (``family.json``, fixed after the pilot and before its runs): the arms on the pilot's cell,
each against the baseline seed by seed, and its report section. Without family.json there is no family yet.

family.json holds: ``fixed`` (date), ``cell`` (the pilot's pick), ``arms`` ({name: train.py's rule as
``none`` or ``<rule>=<value>``}), ``baseline``, ``comparisons`` ([[arm, baseline], ...], Holm over them),
``seeds``, ``steps``, ``decode`` (as pilot.json's; ``at``: a list, the last the endpoint), ``metric``,
``flag_at`` and the reasons for each.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scipy import stats

from studies.regime.grid import CELL_BY_NAME
from studies.regime.stage import HERE, Stage
from studies.stats.paired import holm_adjust, paired_difference, seed_differences, signed_rank_test

FAMILY_FILE = HERE / "family.json"
DIVERGED_WER = 50.0  # pilot.json's "diverged", the family's too
MAX_SKIPPED = 0.10


def family_stage(path: Path = FAMILY_FILE) -> Optional[Stage]:
    """The family's stage, None before family.json is written."""
    if not path.is_file():
        return None
    design = json.loads(path.read_text())
    return Stage("family", design, (CELL_BY_NAME[design["cell"]],), tuple(design["arms"].items()))


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


def _mean_sd(xs: List[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def family_section(stage: Optional[Stage], summaries: Dict[Tuple[str, str, int], Dict]) -> List[str]:
    """The family's report: its design, every arm at every decoding point, and the comparisons."""
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
        convergence_line(stage, summaries),
        "",
        "Each arm minus the baseline, seed by seed, on greedy test-other WER (%) at the endpoint; Holm over the "
        f"{len(d['comparisons'])} comparisons; the exact signed-rank test beside it, not adjusted; diverged runs "
        "(test-other WER at least 50%, or more than 10% of the steps skipped) with Fisher's exact test.",
        "",
        _table(comp, comparison_rows(stage, summaries)),
    ]


def _table(head: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
