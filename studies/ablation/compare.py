"""Paired differences between the ablation's arms: per seed, an arm's value minus the arm without any
control (a seed fixes initialisation and batch order in every arm), its mean, 95% interval and paired t-test
p-value, with Holm's adjustment over the family of WER comparisons that have at least
:data:`MIN_FAMILY_SEEDS` seeds (:mod:`studies.ablation.paired`); and the findings in plain words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from studies.ablation.arms import Arm
from studies.ablation.metrics import Metric, group_runs, valid_loss, wer_metrics
from studies.ablation.paired import PairedDifference, holm_adjust, paired_difference
from studies.ablation.runs import RunResult

# Paired differences with at least this many seeds form the family Holm's adjustment controls.
MIN_FAMILY_SEEDS = 3
FAMILY_ALPHA = 0.05


@dataclass
class Comparison:
    """``arm - baseline`` of one metric in one condition, paired by seed; ``holm_p``: Holm-adjusted p within
    the family (nan outside it)."""

    condition: str
    arm: str
    metric: Metric
    per_seed: Dict[int, float]
    difference: PairedDifference
    holm_p: float = float("nan")

    @property
    def in_family(self) -> bool:
        return self.difference.n >= MIN_FAMILY_SEEDS


def paired_comparisons(
    results: Sequence[RunResult], methods: Sequence[str], baseline: str = "none"
) -> List[Comparison]:
    """Every arm against ``baseline`` in its condition, for every WER and the validation loss; Holm's
    adjustment over the WER comparisons with at least MIN_FAMILY_SEEDS paired seeds (all conditions)."""
    ms = wer_metrics(methods) + [Metric("valid_loss", "valid loss", valid_loss, 3)]
    groups = group_runs(results)
    out: List[Comparison] = []
    for (condition, arm), runs in groups.items():
        if arm == baseline or (condition, baseline) not in groups:
            continue
        base = {r.key.seed: r for r in groups[(condition, baseline)]}
        for m in ms:
            mine = {r.key.seed: m.of(r) for r in runs if r.key.seed in base}
            theirs = {seed: m.of(base[seed]) for seed in mine}
            diffs = {seed: mine[seed] - theirs[seed] for seed in mine}
            out.append(Comparison(condition, arm, m, diffs, paired_difference(mine, theirs)))
    family = [c for c in out if c.in_family and c.metric.name.startswith("wer/")]
    for c, p in zip(family, holm_adjust([c.difference.p for c in family])):
        c.holm_p = p
    return out


def _p(x: float) -> str:
    return "-" if math.isnan(x) else (f"{x:.3f}" if x >= 0.001 else "<0.001")


def format_comparisons(comparisons: Sequence[Comparison], arms: Dict[str, Arm]) -> str:
    header = ["condition", "arm", "metric", "per-seed differences", "mean", "95% interval", "p", "Holm p"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for c in comparisons:
        d, digits = c.difference, c.metric.digits
        per_seed = ", ".join(f"{v:+.{digits}f}" for _, v in sorted(c.per_seed.items()))
        cells = [
            c.condition,
            arms[c.arm].label,
            c.metric.header,
            per_seed,
            "-" if math.isnan(d.mean) else f"{d.mean:+.{digits}f}",
            d.interval(digits),
            _p(d.p),
            _p(c.holm_p) if c.in_family and c.metric.name.startswith("wer/") else "not in family",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def findings(comparisons: Sequence[Comparison], arms: Dict[str, Arm], alpha: float = FAMILY_ALPHA) -> List[str]:
    """One plain sentence per arm and condition: which WER differences hold after Holm's adjustment."""
    by_arm: Dict[Tuple[str, str], List[Comparison]] = {}
    for c in comparisons:
        if c.metric.name.startswith("wer/"):
            by_arm.setdefault((c.condition, c.arm), []).append(c)
    lines = []
    for (condition, arm), cs in by_arm.items():
        held = [c for c in cs if c.in_family and c.holm_p <= alpha]
        parts = [f"{c.metric.header} {c.difference.mean:+.2f} {c.difference.interval(2)}" for c in cs]
        if held:
            verdict = "holds after Holm's adjustment: " + ", ".join(
                f"{c.metric.header} ({'lower' if c.difference.mean < 0 else 'higher'} WER)" for c in held
            )
        elif all(not c.in_family for c in cs):
            verdict = f"fewer than {MIN_FAMILY_SEEDS} paired seeds: descriptive only"
        else:
            verdict = f"no WER difference holds at family-wise {alpha:g}"
        lines.append(f"{condition}: {arms[arm].label} minus none: " + "; ".join(parts) + f"; {verdict}.")
    return lines
