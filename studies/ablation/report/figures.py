"""The report's figures, each computed once: :func:`compute_figures` returns a plain record of what the
headings share (the family's rows, the runs per arm, the replays' controls, the paired differences, the
pilots); the helpers here compute the figures that more than one heading reads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from studies.ablation.arms import seeds_of
from studies.ablation.compare import Comparison, paired_comparisons
from studies.ablation.family import (
    FamilyRow,
    StudyConfig,
    family_rows,
)
from studies.ablation.metrics import (
    group_runs,
)
from studies.ablation.pairing import pair_runs
from studies.ablation.replay.result import ReplayResult, reproduces
from studies.ablation.replay.tables import ReplayMeasures, control_measures
from studies.ablation.runs import RunResult
from studies.stats.paired import PairedDifference, paired_difference


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


def filter_effects(results: Sequence[RunResult], config: StudyConfig, condition: str) -> Dict[int, float]:
    """``{seed: filter - none}`` (the round's first comparison, family.json's) on the metric at ``condition``,
    per seed with both runs on one CPU."""
    first = config.family[0]
    runs = [r for r in results if r.key.condition == condition]
    pairing = pair_runs(
        [r for r in runs if r.key.arm == first.arm],
        [r for r in runs if r.key.arm == first.baseline],
        lambda r: r.wer.get(config.metric, math.nan),
    )
    return pairing.differences


def depth_interaction(deep: Dict[int, float], shallow: Dict[int, float], confidence: float) -> PairedDifference:
    """The filter's effect at the deep condition minus its effect at the shallow one (``{seed: filter -
    none}`` each, :func:`filter_effects`), over the seeds both have: mean and interval."""
    seeds = sorted(set(deep) & set(shallow))
    return paired_difference({k: deep[k] for k in seeds}, {k: shallow[k] for k in seeds}, confidence)


def family_runs(results: Sequence[RunResult], config: StudyConfig, condition: str) -> Dict[str, List[RunResult]]:
    """The runs of the family's arms on ``condition``, by arm (table order), the seeds each arm planned only."""
    planned = {arm: seeds_of(config.first_seed, n) for arm, n in config.seeds_per_arm.items()}
    return {
        arm: [r for r in runs if r.key.seed in planned[arm]]
        for (cond, arm), runs in group_runs(results).items()
        if cond == condition and arm in planned and any(r.key.seed in planned[arm] for r in runs)
    }


def checked_replays(replays: Sequence[ReplayResult], originals: Dict[Tuple[str, int], RunResult]) -> List[ReplayResult]:
    """The replays whose branch (a) reproduces the run at every step of the window (checked)."""
    return [r for r in replays if (o := originals.get((r.key.condition, r.key.seed))) is not None and reproduces(r, o)]


@dataclass
class Figures:
    """What more than one heading reads, computed once from the summaries: the round's condition (or the first
    with runs), the family's rows on it, its runs per arm, the observing arm's run per ``(condition, seed)``
    (the replays' originals), each replay control's differences, every arm's paired differences from the
    observing arm, and the pilots by condition."""

    condition: str
    rows: List[FamilyRow]
    runs_of: Dict[str, List[RunResult]]
    originals: Dict[Tuple[str, int], RunResult]
    measures: Dict[str, ReplayMeasures]
    comparisons: List[Comparison]
    pilot_of: Dict[str, RunResult]


def compute_figures(
    results: Sequence[RunResult],
    replays: Sequence[ReplayResult],
    config: StudyConfig,
    methods: Sequence[str],
    pilots: Sequence[RunResult] = (),
    observing_arm: str = "none",
) -> Figures:
    """The shared figures of a report on ``results`` (at least one run) and ``replays``."""
    conditions = [r.key.condition for r in results]
    condition = config.condition if config.condition in conditions else conditions[0]
    originals = {(r.key.condition, r.key.seed): r for r in results if r.key.arm == observing_arm}
    return Figures(
        condition=condition,
        rows=family_rows(results, config, condition),
        runs_of=family_runs(results, config, condition),
        originals=originals,
        measures=control_measures(replays, originals, methods),
        comparisons=paired_comparisons(results, methods, observing_arm),
        pilot_of={p.key.condition: p for p in pilots},
    )
