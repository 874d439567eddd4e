"""The onset study's measures and tests (onset.json): the plateau exit of a run, the log-rank test and the Cox
hazard ratio of two arms' exits, Fisher's test of two arms' collapses, and the design's power.

The statistics are the field's libraries': statsmodels' log-rank test (``survdiff``) and Cox regression
(``PHReg``), SciPy's Fisher test; Holm's adjustment is studies.stats.paired's.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import stats
from statsmodels.duration.hazard_regression import PHReg
from statsmodels.duration.survfunc import SurvfuncRight, survdiff

from studies.regime.stage import SUMMARIES, WINDOW

# --------------------------------------------------------------------------
# The primary measure of slow-start (a secondary of rescue): the plateau exit
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Exit:
    """When a run left the plateau: ``step`` (the last step of the first window below the level), or the
    budget with ``observed`` False (censored: still on the plateau at the last full window)."""

    step: int
    observed: bool


def plateau_exit(windows: Sequence[Optional[float]], rule: Dict, budget: int) -> Exit:
    """onset.json's plateau exit of a run from its summary's ``loss_per_50_steps`` (window ``i``: the mean
    training loss of steps ``50 i`` to ``50 i + 49``): the end ``50 (i + 1)`` of the first full window that
    starts at or after ``rule["from_step"]`` and whose mean is below ``rule["level"]``; censored at ``budget``
    when no full window up to the budget is."""
    if rule["window"] != WINDOW:
        raise ValueError(f"onset.json's window is {rule['window']} steps; the summaries' is {WINDOW}")
    for i, value in enumerate(windows):
        end = WINDOW * (i + 1)
        if end > budget:
            break
        if WINDOW * i >= rule["from_step"] and value is not None and value < rule["level"]:
            return Exit(end, True)
    return Exit(budget, False)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SurvivalComparison:
    """An arm against the baseline on plateau exits: Kaplan-Meier medians (None: not reached), the Cox hazard
    ratio of leaving the plateau (above 1: the arm leaves sooner) with its 95% interval, the log-rank p and its
    Holm adjustment."""

    arm: str
    baseline: str
    runs: Tuple[int, int]
    censored: Tuple[int, int]
    medians: Tuple[Optional[float], Optional[float]]
    hazard_ratio: float
    low: float
    high: float
    p: float
    holm: float


MEDIAN_TOLERANCE = math.sqrt(np.finfo(float).eps)  # R survival's default tolerance


@dataclass(frozen=True)
class Median:
    """A Kaplan-Meier median exit step: ``step`` None where the curve stays above one half; ``at_least`` where it
    sits at exactly one half from ``step`` to the budget (half the runs still on the plateau there), so that the
    median is ``step`` or later, perhaps past the budget."""

    step: Optional[float]
    at_least: bool = False


def km_median(exits: Sequence[Exit]) -> Median:
    """The Kaplan-Meier median exit step, as R survival's ``quantile.survfit`` finds it: the first exit step at
    which the curve falls below one half; where it sits at exactly one half (within ``MEDIAN_TOLERANCE``) up to a
    later exit, the midpoint of that flat stretch (without censoring: the sample median). Where the flat stretch
    runs to the budget, R takes the midpoint with the budget, a step at which nothing happened: here the median
    is given as at least the stretch's first step. (statsmodels' own ``quantile`` compares strictly, so a curve at
    one half gave the fifth or the sixth exit of ten by the rounding of 0.5.)"""
    if not exits or not any(e.observed for e in exits):
        return Median(None)
    time = np.array([e.step for e in exits], dtype=float)
    status = np.array([e.observed for e in exits], dtype=float)
    curve = SurvfuncRight(time, status)
    steps, surv = curve.surv_times, curve.surv_prob
    for i, (step, s) in enumerate(zip(steps, surv)):
        if abs(s - 0.5) < MEDIAN_TOLERANCE:
            if i + 1 < len(steps):
                return Median(float((step + steps[i + 1]) / 2))
            return Median(float(step), at_least=True)
        if s < 0.5:
            return Median(float(step))
    return Median(None)


def logrank(a: Sequence[Exit], b: Sequence[Exit]) -> float:
    """The two-sided log-rank p-value of two groups of exits (statsmodels' ``survdiff``); nan where no run of
    either left the plateau."""
    exits = [*a, *b]
    if not any(e.observed for e in exits):
        return math.nan
    time = np.array([e.step for e in exits], dtype=float)
    status = np.array([e.observed for e in exits], dtype=float)
    group = np.array([1] * len(a) + [0] * len(b))
    return float(survdiff(time, status, group)[1])


def hazard_ratio(a: Sequence[Exit], b: Sequence[Exit]) -> Tuple[float, float, float]:
    """Cox regression (statsmodels' ``PHReg``, Breslow's ties) of the exits on an indicator of ``a``: the hazard
    ratio of ``a`` against ``b`` and its (Wald) 95% interval; nans where a group has no run or no run left;
    infinite (or 0) without an interval where no run of ``b`` left the plateau while a run of ``a`` was still
    on it (or the other way round), including where one group has no exit at all."""
    exits = [*a, *b]
    time = np.array([e.step for e in exits], dtype=float)
    status = np.array([e.observed for e in exits], dtype=float)
    exog = np.array([[1.0]] * len(a) + [[0.0]] * len(b))
    if not a or not b or not status.any():
        return math.nan, math.nan, math.nan
    if _separated(a, b) or _separated(b, a):  # the likelihood has no maximum: the ratio is 0 or infinite
        return (math.inf if _separated(a, b) else 0.0), math.nan, math.nan
    with np.errstate(all="ignore"):
        fit = PHReg(time, exog, status=status, ties="breslow").fit(disp=False)
    low, high = fit.conf_int()[0]
    return float(math.exp(fit.params[0])), float(math.exp(low)), float(math.exp(high))


def _separated(a: Sequence[Exit], b: Sequence[Exit]) -> bool:
    """Whether no run of ``b`` left the plateau while a run of ``a`` was still on it: ``b`` has no exit, or every
    run of ``a`` left before any run of ``b`` left or was censored (censoring is at the budget only)."""
    if not a or not b:
        return False
    if not any(e.observed for e in b):
        return any(e.observed for e in a)
    return all(e.observed for e in a) and max(e.step for e in a) < min(e.step for e in b)


def fisher(a: Tuple[int, int], b: Tuple[int, int]) -> float:
    """Fisher's exact two-sided p of ``(events, runs)`` in two groups (SciPy); nan when a group has no run.
    With events in every run of both groups, or in none, every table with those margins is the observed one:
    p is 1 (SciPy's answer too), and the report shows it rather than a dash."""
    table = [[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]]
    if not a[1] or not b[1]:
        return math.nan
    return float(stats.fisher_exact(table).pvalue)


# --------------------------------------------------------------------------
# Power, for the design
# --------------------------------------------------------------------------


def resampled_power(
    arm: Sequence[int], baseline: Sequence[int], n: int, alpha: float, draws: int = 4000, seed: int = 0
) -> float:
    """The share of ``draws`` resampled experiments (``n`` runs an arm, drawn with replacement from the observed
    exit steps ``arm`` and ``baseline``, none censored) in which the log-rank test rejects at ``alpha``."""
    rng = random.Random(seed)
    hits = 0
    for _ in range(draws):
        a = [Exit(rng.choice(arm), True) for _ in range(n)]
        b = [Exit(rng.choice(baseline), True) for _ in range(n)]
        p = logrank(a, b)
        hits += math.isfinite(p) and p < alpha
    return hits / draws


def fisher_largest_rate(baseline: int, n: int, alpha: float) -> Optional[int]:
    """The most collapses of ``n`` an arm may have for Fisher's test against ``baseline`` of ``n`` to reject at
    ``alpha``; None when no count does."""
    for k in range(baseline, -1, -1):
        p = fisher((k, n), (baseline, n))
        if math.isfinite(p) and p < alpha:
            return k
    return None


def exploratory_exits(rule: Dict, budget: int) -> Dict[str, List[int]]:
    """The regime family's runs (``12-layers.mix-2``, 2,700 steps), the exploratory data that prompted the
    slow-start question: each arm's plateau exits by onset.json's rule (none censored there)."""
    out: Dict[str, List[int]] = {}
    for path in sorted((SUMMARIES / "family").glob("*/*/seed-*.json")):
        s = json.loads(path.read_text())
        e = plateau_exit(s["loss_per_50_steps"], rule, budget)
        out.setdefault(s["key"]["arm"], []).append(e.step if e.observed else math.inf)
    return out


def design_power(design: Dict) -> Dict[str, float]:
    """slow-start's power per arm at Holm's first step (alpha / comparisons), by :func:`resampled_power` from
    :func:`exploratory_exits`: the figures onset.json states."""
    q = design["slow-start"]
    rule, alpha = q["plateau"], 0.05 / len(q["comparisons"])
    exits = exploratory_exits(rule, q["steps"])
    return {arm: resampled_power(exits[arm], exits[base], len(q["seeds"]), alpha) for arm, base in q["comparisons"]}
