"""The study's configuration, fixed before the runs of a round (``family.json`` beside this file): the budget
and how runs are decoded, the primary metric, the family of comparisons and its test, the seeds per arm and
the power they were chosen for, the time the plan takes, the guard's threshold, the replays, the plateau
measure. Every number in it that comes from an earlier round is recomputed by
``tests/test_ablation_family.py``.

Also here: the family's comparisons computed from the runs (paired by seed, on one CPU model; paired t with
Holm's adjustment, the exact signed-rank test beside it) and their table, whose verdicts are written from
their numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from studies.ablation.arm_names import canonical_arm
from studies.ablation.markdown import markdown_table
from studies.ablation.pairing import Pairing, pair_runs
from studies.ablation.records import RunResult
from studies.stats.paired import (
    PairedDifference,
    SignedRank,
    holm_adjust,
    paired_difference,
    signed_rank_test,
    smallest_signed_rank_p,
)
from studies.stats.power import paired_t_power

CONFIG_PATH = Path(__file__).with_name("family.json")


@dataclass(frozen=True)
class FamilyComparison:
    """``arm - baseline`` of the primary metric, paired by seed."""

    arm: str
    baseline: str

    @property
    def name(self) -> str:
        return f"{self.arm} - {self.baseline}"


@dataclass(frozen=True)
class Pilot:
    seed: int
    steps: int
    decode_at: Tuple[int, ...]
    max_late_change: float
    min_metric_wer: float


@dataclass(frozen=True)
class Budget:
    """A condition's budget: its steps, the steps a run is decoded at (the last one the budget), and the pilot
    that checks it."""

    steps: int
    decode_at: Tuple[int, ...]
    pilot: Pilot
    kept: str = ""  # why the budget stays although its pilot did not confirm it (family.json), or ""


@dataclass(frozen=True)
class StudyConfig:
    """``family.json``, read and checked (see the file for the reasons of every value)."""

    round: str
    fixed: str
    summaries: str
    condition: str
    steps: int
    decode_at: Tuple[int, ...]
    save_every_n: int
    average_period: int
    avg: int
    use_averaged_model: bool
    pilot: Pilot
    metric: Tuple[str, str]
    alpha: float
    confidence: float
    family: Tuple[FamilyComparison, ...]
    first_seed: int
    seeds_per_arm: Dict[str, int]
    planned_effect: float  # the standardised effect of the first comparison the seed counts were chosen for
    power_target: float
    guard_clip_grad_norm: float
    clip_grad_norm_relative: Tuple[float, ...]
    replay_events: int
    replays_per_seed: int
    replay_min_seeds: int
    replay_window: int
    matched_max_ratio: float
    plateau_loss: float
    plateau_window: int
    landscape_family: Tuple[FamilyComparison, ...]  # issue 39's arms against none: a family of its own
    landscape_seeds: int
    depth_condition: (
        str  # the deep condition (arms.CONDITIONS) whose arms are compared with none (family.json's "depth")
    )
    depth_family: Tuple[FamilyComparison, ...]
    depth_seeds: int
    depth_learns_at_most: float  # the deep condition learns when every arm's mean metric is at most this
    depth_budget: Budget  # the deep condition's own budget (family.json's depth.budget)
    raw: Dict

    def budget_of(self, condition: str) -> Budget:
        """The budget of ``condition``: the deep condition's own, the round's for every other."""
        if condition == self.depth_condition:
            return self.depth_budget
        return Budget(self.steps, self.decode_at, self.pilot)

    @property
    def average_window(self) -> int:
        """Steps the averaged model of a decoding spans: ``avg`` checkpoints of ``save_every_n`` steps."""
        return self.avg * self.save_every_n


def _check(config: StudyConfig) -> None:
    problems = []
    points = []
    for where, b in (("budget", config.budget_of(config.condition)), ("depth.budget", config.depth_budget)):
        if b.decode_at[-1] != b.steps:
            problems.append(f"{where}: the last decoding point ({b.decode_at[-1]}) is not the budget ({b.steps})")
        if not {b.steps, b.pilot.steps} <= set(b.pilot.decode_at) or b.pilot.steps <= b.steps:
            problems.append(
                f"{where}.pilot: it must go past the budget ({b.steps}) and be decoded at the budget and its end"
            )
        points += [*b.decode_at, *b.pilot.decode_at]
    for point in points:
        start = point - config.average_window
        if start < 0 or point % config.save_every_n or start % config.average_period:
            problems.append(
                f"decoding at {point} averages from step {start}: both must be checkpoint steps (multiples of "
                f"{config.save_every_n}) and the start a multiple of the average period {config.average_period}"
            )
    if config.replay_window % config.save_every_n:
        problems.append(
            f"the replay window ({config.replay_window}) must be a multiple of save_every_n "
            f"({config.save_every_n}): branch (d) ends on a checkpoint of the run"
        )
    arms = set(config.seeds_per_arm)
    for c in config.family:
        if not {c.arm, c.baseline} <= arms:
            problems.append(f"family comparison {c.name}: an arm without seeds")
    reasons = landscape_reasons(config)
    for c in config.landscape_family:
        if c.arm not in reasons:
            problems.append(
                f"landscape comparison {c.name}: its arm's threshold is not given a reason in landscape.arms"
            )
        elif not all(landscape_rule(config, c.arm)):
            problems.append(
                f"landscape.arms[{c.arm!r}] must read '<threshold and its reason>; <granularity>, <what it reacts to>'"
            )
    if problems:
        raise ValueError("studies/ablation/family.json: " + "; ".join(problems))


def landscape_rule(config: StudyConfig, arm: str) -> Tuple[str, str, str]:
    """A landscape rule's threshold with its reason, its granularity and what it reacts to: family.json's
    "landscape" text for ``arm``, "<threshold and its reason>; <granularity>, <what it reacts to>" (the
    reason may hold semicolons of its own; the last one ends it)."""
    threshold, _, kind = landscape_reasons(config)[arm].rpartition(";")
    granularity, _, reacts = kind.strip().partition(", ")
    return threshold, granularity, reacts


def landscape_reasons(config: StudyConfig) -> Dict[str, str]:
    """family.json's "landscape" reason for each arm's threshold, by the arm's name now."""
    return {canonical_arm(arm): text for arm, text in config.raw["landscape"]["arms"].items()}


def _comparisons(pairs: Sequence[Sequence[str]]) -> Tuple[FamilyComparison, ...]:
    """family.json's ``[arm, baseline]`` pairs, by the arms' names now (the file keeps the names of its day)."""
    return tuple(FamilyComparison(canonical_arm(a), canonical_arm(b)) for a, b in pairs)


def _pilot(raw: Dict, rule: Dict) -> Pilot:
    """A pilot's seed, steps and points from ``raw``; its rule (the late change allowed, the floor) from ``rule``
    (the round's budget.pilot: one rule for every budget)."""
    return Pilot(
        int(raw["seed"]),
        int(raw["steps"]),
        tuple(int(x) for x in raw["decode_at"]),
        float(rule["max_late_change"]),
        float(rule["min_metric_wer"]),
    )


def load_config(path: Path = CONFIG_PATH) -> StudyConfig:
    """Read ``family.json``; ValueError naming what does not fit together."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    budget, test, seeds, replays = raw["budget"], raw["test"], raw["seeds"], raw["replays"]
    metric = tuple(raw["metric"])
    power = seeds["power"][metric[1]]
    config = StudyConfig(
        round=raw["round"],
        fixed=raw["fixed"],
        summaries=raw["summaries"],
        condition=raw["condition"],
        steps=int(budget["steps"]),
        decode_at=tuple(int(x) for x in budget["decode_at"]),
        save_every_n=int(budget["save_every_n"]),
        average_period=int(budget["average_period"]),
        avg=int(budget["avg"]),
        use_averaged_model=bool(budget["use_averaged_model"]),
        pilot=_pilot(budget["pilot"], budget["pilot"]),
        metric=metric,
        alpha=float(test["alpha"]),
        confidence=float(test["confidence"]),
        family=_comparisons(raw["family"]),
        first_seed=int(seeds["first"]),
        seeds_per_arm={canonical_arm(arm): int(n) for arm, n in seeds["per_arm"].items()},
        planned_effect=float(power["standardised"]),
        power_target=float(seeds["power"]["target"]),
        guard_clip_grad_norm=float(raw["arms"]["guard_clip_grad_norm"]),
        clip_grad_norm_relative=tuple(float(x) for x in raw["arms"]["clip_grad_norm_relative"]),
        replay_events=int(replays["events"]),
        replays_per_seed=int(replays["per_seed"]),
        replay_min_seeds=int(replays["min_seeds"]),
        replay_window=int(replays["window"]),
        matched_max_ratio=float(replays["matched_max_ratio"]),
        plateau_loss=float(raw["plateau"]["loss"]),
        plateau_window=int(raw["plateau"]["window"]),
        landscape_family=_comparisons(raw["landscape"]["family"]),
        landscape_seeds=int(raw["landscape"]["seeds_per_arm"]),
        depth_condition=raw["depth"]["condition"],
        depth_family=_comparisons(raw["depth"]["family"]),
        depth_seeds=int(raw["depth"]["seeds_per_arm"]),
        depth_learns_at_most=float(raw["depth"]["learns_at_most"]),
        depth_budget=Budget(
            int(raw["depth"]["budget"]["steps"]),
            tuple(int(x) for x in raw["depth"]["budget"]["decode_at"]),
            _pilot(raw["depth"]["budget"]["pilot"], budget["pilot"]),
            raw["depth"]["budget"].get("kept", ""),
        ),
        raw=raw,
    )
    _check(config)
    return config


# --------------------------------------------------------------------------
# The family's comparisons
# --------------------------------------------------------------------------


@dataclass
class FamilyRow:
    """One comparison of the family, computed: the pairs used (and those left out), the paired t statistics,
    Holm's p over the family, the signed-rank check."""

    comparison: FamilyComparison
    pairing: Pairing
    difference: PairedDifference
    signed_rank: SignedRank
    holm_p: float = math.nan

    @property
    def per_seed(self) -> Dict[int, float]:
        return self.pairing.differences


def family_rows(
    results: Sequence[RunResult],
    config: StudyConfig,
    condition: str,
    family: Optional[Sequence[FamilyComparison]] = None,
) -> List[FamilyRow]:
    """Every comparison of ``family`` (default: the round's) in ``condition`` (those without runs too: 0 pairs),
    Holm over the comparisons with at least 2 pairs."""
    rows = []
    for c in config.family if family is None else family:
        arm = [r for r in results if r.key.condition == condition and r.key.arm == c.arm]
        base = [r for r in results if r.key.condition == condition and r.key.arm == c.baseline]
        pairing = pair_runs(arm, base, lambda r: r.wer.get(config.metric, math.nan))
        diffs = list(pairing.differences.values())
        rows.append(
            FamilyRow(
                c,
                pairing,
                paired_difference(pairing.arm_values, pairing.baseline_values, config.confidence),
                signed_rank_test(diffs),
            )
        )
    for row, p in zip(rows, holm_adjust([r.difference.p for r in rows])):
        row.holm_p = p
    return rows


def format_p(x: float) -> str:
    return "-" if math.isnan(x) else (f"{x:.3f}" if x >= 0.001 else "<0.001")


def verdict(row: FamilyRow, alpha: float, planned: int = 0, others_short: int = 0) -> str:
    """The comparison in words, from its numbers: whether it holds after Holm, its direction and size, the
    range the interval allows, and whether the signed-rank check agrees (or cannot, with so few pairs). With
    fewer than its ``planned`` pairs in, or ``others_short`` of the family's other comparisons short of theirs,
    no Holm verdict: the test was fixed at the planned pairs of the whole family (Holm's p of one comparison
    depends on every other's), and a look before then is not that test."""
    d, n = row.difference, row.difference.n
    if n < 2:
        return f"not tested: {n} pair(s)"
    if n < planned or others_short:
        have = f"{n} of its {planned} planned pairs" if n < planned else f"its {planned} planned pairs in"
        if others_short:
            have += f", {others_short} of the family's other comparisons short of theirs"
        return (
            f"not tested yet: {have} (Holm p {format_p(row.holm_p)} now, a look before the test); the interval "
            f"allows {d.low:+.2f} to {d.high:+.2f}"
        )
    if row.holm_p <= alpha:
        direction = "lower" if d.mean < 0 else "higher"
        words = f"{row.comparison.arm} {direction} by {abs(d.mean):.2f} points, holds after Holm"
        words += f" (p {format_p(row.holm_p)})"
    else:
        words = (
            f"no difference shown at family-wise {alpha:g} (Holm p {format_p(row.holm_p)}); "
            f"the interval allows {d.low:+.2f} to {d.high:+.2f}"
        )
    smallest = smallest_signed_rank_p(row.signed_rank.n)
    if smallest > alpha:
        words += f"; the signed-rank test cannot reach {alpha:g} with {row.signed_rank.n} non-zero pairs"
        words += f" (its smallest p is {smallest:.3f})"
    elif (row.signed_rank.p <= alpha) != (row.holm_p <= alpha):
        agree = "reaches" if row.signed_rank.p <= alpha else "does not reach"
        words += f"; the signed-rank check {agree} {alpha:g} (p {format_p(row.signed_rank.p)}, unadjusted)"
    else:
        words += f"; the signed-rank check agrees (p {format_p(row.signed_rank.p)}, unadjusted)"
    return words


def planned_pairs(comparison: FamilyComparison, seeds_per_arm: Dict[str, int]) -> int:
    """The pairs a comparison is tested at: the smaller of its two arms' planned seeds (0 without a plan)."""
    return min(seeds_per_arm.get(comparison.arm, 0), seeds_per_arm.get(comparison.baseline, 0))


def family_verdicts(rows: Sequence[FamilyRow], alpha: float, planned: Sequence[int]) -> List[str]:
    """Each comparison's verdict, with ``planned[i]`` the pairs comparison ``i`` is tested at: until every
    comparison has its planned pairs, none gets a Holm verdict (see ``verdict``)."""
    short = [row.difference.n < n for row, n in zip(rows, planned)]
    return [verdict(row, alpha, n, sum(short) - s) for row, n, s in zip(rows, planned, short)]


def format_family_table(
    rows: Sequence[FamilyRow], labels: Dict[str, str], config: StudyConfig, seeds_per_arm: Optional[Dict[str, int]]
) -> str:
    """One row per comparison of the family. ``seeds_per_arm``: each arm's seeds as fixed before the runs; a
    comparison is tested at the smaller count of its two arms, and until every comparison's pairs are in the
    verdicts say so. None for runs whose family was fixed after them: the verdicts are then marked as
    descriptions."""
    fixed_before = seeds_per_arm is not None
    header = [
        "comparison",
        "pairs",
        "per-seed differences",
        "mean difference",
        f"{100 * config.confidence:g}% interval (unadjusted)",
        "Holm p",
        "signed-rank p",
        "verdict" if fixed_before else "verdict (computed after the runs: a description)",
    ]
    out = []
    planned = [planned_pairs(row.comparison, seeds_per_arm or {}) for row in rows]
    for row, words in zip(rows, family_verdicts(rows, config.alpha, planned)):
        c, d = row.comparison, row.difference
        name = f"{labels.get(c.arm, c.arm)} − {labels.get(c.baseline, c.baseline)}"
        out.append(
            [
                name,
                str(d.n),
                ", ".join(f"{v:+.2f}" for _, v in sorted(row.per_seed.items())) or "-",
                "-" if math.isnan(d.mean) else f"{d.mean:+.2f}",
                d.interval(2),
                format_p(row.holm_p),
                format_p(row.signed_rank.p),
                words,
            ]
        )
    return markdown_table(header, out)


def power_now(rows: Sequence[FamilyRow], config: StudyConfig) -> Optional[Tuple[int, float]]:
    """The first comparison's pairs and the power they have at the effect the seed counts were planned for
    (Holm's first step, alpha / m); None without pairs."""
    n = rows[0].difference.n if rows else 0
    if n < 2:
        return None
    return n, paired_t_power(abs(config.planned_effect), n, config.alpha / len(config.family))
