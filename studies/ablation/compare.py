"""Descriptive paired differences between the ablation's arms: per seed, an arm's value minus the arm without
any control (a seed fixes initialisation and batch order in every arm; runs on two CPU models are not
paired, :mod:`studies.ablation.pairing`), its mean and 95% interval, for every WER and the validation loss.

These are descriptions, not tests: the tests are the family's (:mod:`studies.ablation.family`), fixed before
the runs, with Holm's adjustment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

from studies.ablation.arms import Arm
from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import Metric, group_runs, valid_loss, wer_metrics
from studies.ablation.pairing import Pairing, pair_runs
from studies.ablation.runs import RunResult
from studies.stats.paired import PairedDifference, paired_difference


@dataclass
class Comparison:
    """``arm - baseline`` of one metric in one condition, paired by seed on one CPU model."""

    condition: str
    arm: str
    metric: Metric
    pairing: Pairing
    difference: PairedDifference

    @property
    def per_seed(self) -> Dict[int, float]:
        return self.pairing.differences


def paired_comparisons(
    results: Sequence[RunResult], methods: Sequence[str], baseline: str = "none"
) -> List[Comparison]:
    """Every arm against ``baseline`` in its condition, for every WER and the validation loss."""
    ms = wer_metrics(methods) + [Metric("valid_loss", "valid loss", valid_loss, 3)]
    groups = group_runs(results)
    out: List[Comparison] = []
    for (condition, arm), runs in groups.items():
        if arm == baseline or (condition, baseline) not in groups:
            continue
        for m in ms:
            pairing = pair_runs(runs, groups[(condition, baseline)], m.of)
            out.append(
                Comparison(condition, arm, m, pairing, paired_difference(pairing.arm_values, pairing.baseline_values))
            )
    return out


def format_comparisons(comparisons: Sequence[Comparison], arms: Dict[str, Arm]) -> str:
    header = ["condition", "arm", "metric", "pairs", "per-seed differences", "mean", "95% interval"]
    rows = []
    for c in comparisons:
        d, digits = c.difference, c.metric.digits
        rows.append(
            [
                c.condition,
                arms[c.arm].label,
                c.metric.header,
                str(d.n),
                ", ".join(f"{v:+.{digits}f}" for _, v in sorted(c.per_seed.items())) or "-",
                "-" if math.isnan(d.mean) else f"{d.mean:+.{digits}f}",
                d.interval(digits),
            ]
        )
    return markdown_table(header, rows)
