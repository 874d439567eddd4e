"""The regime study's confirmatory stage (``onset.json``, fixed before its runs): two questions with a design
each, run as two stages of :class:`studies.regime.stage.Stage`.

- *slow-start*: does gradient control shorten the 12-layer model's slow start? Measured by the plateau exit
  (:func:`plateau_exit`), censored at the budget; log-rank test and Cox hazard ratio per arm against ``none``.
- *rescue*: where training without control collapses (``lr-x10.clean``), does a control save it? Measured by
  the share of runs that collapse (the studies' divergence rule), Fisher's exact test per arm against ``none``;
  only once ``none`` collapsed in most of its runs (the gate, run first).

The statistics are the field's libraries': statsmodels' log-rank test (``survdiff``) and Cox regression
(``PHReg``), SciPy's Fisher test, statsmodels' Holm adjustment.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import stats
from statsmodels.duration.hazard_regression import PHReg
from statsmodels.duration.survfunc import survdiff
from statsmodels.stats.multitest import multipletests

from studies.regime.family import diverged
from studies.regime.grid import CELL_BY_NAME
from studies.regime.stage import HERE, WINDOW, Run, Stage

DESIGN_FILE = HERE / "onset.json"
QUESTIONS = ("slow-start", "rescue")
Summaries = Dict[Tuple[str, str, int], Dict]


def load_design(path: Path = DESIGN_FILE) -> Optional[Dict]:
    """onset.json, None before it is written."""
    return json.loads(path.read_text()) if path.is_file() else None


def question_stage(name: str, design: Dict) -> Stage:
    """The stage of question ``name`` (a key of onset.json); its summaries keep the digest of the first
    ``verify_steps`` steps' training loss."""
    q = {**design[name], "verify_steps": design["verify_steps"]}
    return Stage(name, q, (CELL_BY_NAME[q["cell"]],), tuple(q["arms"].items()))


def gate_runs(rescue: Stage) -> List[Run]:
    """rescue's gate: the baseline's runs, made before any other arm's."""
    return [r for r in rescue.runs() if r.arm == rescue.design["baseline"]]


def gate_passed(rescue: Stage, summaries: Summaries) -> Optional[bool]:
    """Whether the baseline collapsed in at least ``gate_min_collapsed`` of its runs; None before every gate run
    is in."""
    runs = [summaries.get((r.cell.name, r.arm, r.seed)) for r in gate_runs(rescue)]
    if any(s is None for s in runs):
        return None
    return sum(map(diverged, runs)) >= rescue.design["gate_min_collapsed"]


def run_all(design: Dict, after_each: Callable[[], object]) -> None:
    """onset.json's order: rescue's gate, slow-start seed by seed, then (the gate passed) rescue's other arms."""
    slow, rescue = (question_stage(q, design) for q in QUESTIONS)
    rescue.run_all(after_each, only=gate_runs(rescue))
    slow.run_all(after_each)
    if gate_passed(rescue, rescue.load_summaries()):
        rescue.run_all(after_each)


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


def km_median(exits: Sequence[Exit]) -> Optional[float]:
    """The Kaplan-Meier median exit step: the first step at which the estimated share still on the plateau is at
    most one half; None when it is not reached (half or more censored before)."""
    at_risk, share = len(exits), 1.0
    for step in sorted({e.step for e in exits}):
        events = sum(e.observed and e.step == step for e in exits)
        if events:
            share *= 1.0 - events / at_risk
            if share <= 0.5:
                return float(step)
        at_risk -= sum(e.step == step for e in exits)
    return None


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
    ratio of ``a`` against ``b`` and its 95% interval; nans where it cannot be fitted (no event, or one group
    without an event or censoring that separates them)."""
    exits = [*a, *b]
    time = np.array([e.step for e in exits], dtype=float)
    status = np.array([e.observed for e in exits], dtype=float)
    exog = np.array([[1.0]] * len(a) + [[0.0]] * len(b))
    if not status.any() or not status[: len(a)].any() or not status[len(a) :].any():
        return math.nan, math.nan, math.nan
    with np.errstate(all="ignore"):
        fit = PHReg(time, exog, status=status, ties="breslow").fit(disp=False)
    low, high = fit.conf_int()[0]
    return float(math.exp(fit.params[0])), float(math.exp(low)), float(math.exp(high))


def holm(ps: Sequence[float]) -> List[float]:
    """Holm's adjustment (statsmodels) of the finite p-values; nan stays nan."""
    finite = [i for i, p in enumerate(ps) if math.isfinite(p)]
    out = [math.nan] * len(ps)
    if finite:
        adjusted = multipletests([ps[i] for i in finite], method="holm")[1]
        for i, p in zip(finite, adjusted):
            out[i] = float(p)
    return out


def fisher(a: Tuple[int, int], b: Tuple[int, int]) -> float:
    """Fisher's exact two-sided p of ``(events, runs)`` in two groups (SciPy); nan without any event or any
    non-event."""
    table = [[a[0], a[1] - a[0]], [b[0], b[1] - b[0]]]
    if a[0] + b[0] == 0 or a[0] + b[0] == a[1] + b[1]:
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
    for path in sorted((HERE / "summaries" / "family").glob("*/*/seed-*.json")):
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
