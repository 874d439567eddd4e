"""The numbers a round of the ablation is planned from, computed from an earlier round's run summaries: the
paired effect a comparison showed (for the seed counts), the median pre-clip gradient norm of the arm without
control (for the guard's threshold), and the wall time per training step and per decoding (for the time a
plan takes). ``tests/test_ablation_family.py`` recomputes every such number written into
``studies/ablation/family.json`` from the committed summaries it names.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

from studies.ablation.metrics import group_runs
from studies.ablation.runs import RunResult
from studies.stats.power import paired_t_power, pairs_for_power


@dataclass(frozen=True)
class Effect:
    """Paired differences ``arm - baseline`` of one WER over the seeds both have: their mean, standard
    deviation, the standardised effect (mean / sd) and the number of pairs."""

    mean: float
    sd: float
    n: int

    @property
    def standardised(self) -> float:
        return self.mean / self.sd


def observed_effect(results: Sequence[RunResult], arm: str, baseline: str, metric: Tuple[str, str]) -> Effect:
    """The paired effect of ``arm - baseline`` on ``metric`` (method, test set) over the seeds both have."""
    groups = group_runs(results)
    condition = results[0].key.condition
    mine = {r.key.seed: r.wer[metric] for r in groups.get((condition, arm), [])}
    theirs = {r.key.seed: r.wer[metric] for r in groups.get((condition, baseline), [])}
    diffs = [mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))]
    if len(diffs) < 2:
        raise ValueError(f"{arm} - {baseline}: {len(diffs)} paired seeds; an effect needs at least 2")
    return Effect(statistics.mean(diffs), statistics.stdev(diffs), len(diffs))


def power_plan(effect: Effect, comparisons: int, alpha: float, target: float, at: Sequence[int]) -> Dict:
    """Pairs needed for ``target`` power at ``effect`` under Holm over ``comparisons`` (tested at alpha / m,
    :mod:`studies.stats.power`), and the power at each number of pairs in ``at``."""
    level = alpha / comparisons
    return {
        "pairs_needed": pairs_for_power(abs(effect.standardised), level, target),
        "power_at": {str(n): round(paired_t_power(abs(effect.standardised), n, level), 3) for n in at},
    }


def median_pre_clip_norm(results: Sequence[RunResult], arm: str) -> Tuple[float, int]:
    """The median of ``arm``'s pre-clip global gradient norm (TensorBoard ``train/grad_norm``) over every step
    after warm-up of all its runs, pooled; and the number of those steps."""
    xs = [
        v
        for r in results
        if r.key.arm == arm
        for step, v in r.series("grad_norm")
        if step >= r.warm_end and math.isfinite(v)
    ]
    if not xs:
        raise ValueError(f"no gradient norms of arm {arm} after warm-up")
    return statistics.median(xs), len(xs)


def seconds_per_step(results: Sequence[RunResult]) -> float:
    """Training wall time per step (validation at the end included), over every run: total over total."""
    return sum(r.wall_s.get("train", 0.0) for r in results) / sum(r.steps for r in results)


def seconds_per_decoding(results: Sequence[RunResult], method: str) -> float:
    """Mean wall time of one decoding of both test sets with ``method``, over the runs."""
    xs = [r.wall_s[f"decode/{method}"] for r in results if f"decode/{method}" in r.wall_s]
    return statistics.mean(xs)
