"""Paired comparisons over seeds: the mean per-seed difference between two arms, its confidence interval and
p-value (the paired t-test: SciPy's one-sample t-test of the differences), Holm's step-down adjustment for a
family of such comparisons (statsmodels), and the exact Wilcoxon signed-rank test beside the t-test (SciPy).

A seed fixes the initialisation and the batch order in every arm, so the difference ``arm - baseline`` of one
seed removes what the seeds share; the t-test on those differences is the paired t-test. The signed-rank
test's p-value is exact and counts ties as they are: the share of all 2^n sign patterns of the differences'
mid-ranks whose positive rank sum is at least as far from its mean as the observed one (SciPy's permutation
test with every pattern enumerated). SciPy's ``method="exact"`` would instead take the distribution of
untied ranks 1..n, which is not the null of differences with tied magnitudes (WER differences at 2 decimals
tie often).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedDifference:
    """``arm - baseline`` over paired seeds: mean, the 95% interval, the two-sided p-value, the seeds used."""

    mean: float
    low: float
    high: float
    p: float
    n: int

    def interval(self, digits: int) -> str:
        if self.n < 2 or not math.isfinite(self.low):
            return "-"
        return f"[{_bound(self.low, digits)}, {_bound(self.high, digits)}]"


def _bound(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals, or up to 3 more where those would print a non-zero bound as 0 (whether an
    interval holds 0 must be read off it)."""
    for d in range(digits, digits + 4):
        text = f"{x:+.{d}f}"
        if x == 0 or text.strip("+-0.") != "":
            return text
    return text


def seed_differences(arm: Dict[int, float], baseline: Dict[int, float]) -> List[float]:
    """``arm[seed] - baseline[seed]`` over the seeds both have with finite values, in seed order."""
    return [
        arm[s] - baseline[s]
        for s in sorted(set(arm) & set(baseline))
        if math.isfinite(arm[s]) and math.isfinite(baseline[s])
    ]


def paired_difference(
    arm: Dict[int, float], baseline: Dict[int, float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """The paired t statistics of ``arm[seed] - baseline[seed]`` over the seeds both have with finite values
    (the interval at ``confidence``).

    With fewer than 2 pairs, the interval and p-value are nan; with differences that are all equal, the
    interval is that value and p is 0 (if it is not 0) or 1 (the t statistic is undefined there).
    """
    diffs = seed_differences(arm, baseline)
    n = len(diffs)
    if n == 0:
        return PairedDifference(math.nan, math.nan, math.nan, math.nan, 0)
    mean = statistics.mean(diffs)
    if n < 2:
        return PairedDifference(mean, math.nan, math.nan, math.nan, n)
    if statistics.stdev(diffs) == 0.0:
        return PairedDifference(mean, mean, mean, 1.0 if mean == 0.0 else 0.0, n)
    test = stats.ttest_1samp(diffs, 0.0)
    interval = test.confidence_interval(confidence)
    return PairedDifference(mean, float(interval.low), float(interval.high), float(test.pvalue), n)


def holm_adjust(p_values: Sequence[float]) -> List[float]:
    """Holm's step-down adjusted p-values, in the input order (nan stays nan and is not counted).

    Reject comparison i at family-wise level alpha when its adjusted p is at most alpha.
    """
    finite = [i for i, p in enumerate(p_values) if math.isfinite(p)]
    adjusted = [math.nan] * len(p_values)
    if finite:
        _, holm, _, _ = multipletests([p_values[i] for i in finite], method="holm")
        for i, p in zip(finite, holm):
            adjusted[i] = float(p)
    return adjusted


@dataclass(frozen=True)
class SignedRank:
    """The Wilcoxon signed-rank test of paired differences: the non-zero differences used, the sum of the
    ranks of the positive ones, and the exact two-sided p-value (nan without a non-zero difference)."""

    n: int
    w_plus: float
    p: float


def _positive_rank_sum(signed_ranks: np.ndarray, axis: int) -> np.ndarray:
    """The signed-rank statistic W+: the sum of the positive ones of ``signed_ranks`` along ``axis``."""
    return np.sum(np.where(signed_ranks > 0, signed_ranks, 0.0), axis=axis)


def signed_rank_test(differences: Sequence[float]) -> SignedRank:
    """The exact two-sided Wilcoxon signed-rank test of ``differences`` (finite ones): zero differences dropped
    (Wilcoxon's rule), tied magnitudes at the mean of their ranks, the p-value over every sign pattern.

    SciPy's permutation test of W+ over the signed mid-ranks; ``scipy.stats.wilcoxon`` with the permutation
    method gives the same p-value but ranks every pattern anew (7 s at 17 pairs, against 0.6 s here).
    """
    xs = [d for d in differences if math.isfinite(d) and d != 0.0]
    if not xs:
        return SignedRank(0, 0.0, math.nan)
    signed_ranks = np.sign(xs) * stats.rankdata(np.abs(xs), method="average")
    w_plus = float(_positive_rank_sum(signed_ranks, axis=0))
    if len(xs) == 1:  # both sign patterns are as extreme (SciPy's permutation test needs two differences)
        return SignedRank(1, w_plus, 1.0)
    test = stats.permutation_test(
        (signed_ranks,),
        _positive_rank_sum,
        permutation_type="samples",
        n_resamples=np.inf,
        vectorized=True,
        alternative="two-sided",
    )
    return SignedRank(len(xs), w_plus, min(1.0, float(test.pvalue)))


def smallest_signed_rank_p(n: int) -> float:
    """The smallest two-sided p-value the exact signed-rank test can give with ``n`` non-zero differences
    (all of one sign, no ties): 2 / 2^n (1 with none)."""
    return 1.0 if n == 0 else min(1.0, 2.0 / 2**n)


def mid_ranks(xs: Sequence[float]) -> List[float]:
    """Ranks 1..n of ``xs`` (ascending), ties at the mean of the ranks they span (SciPy's ``rankdata``)."""
    return [float(r) for r in stats.rankdata(xs, method="average")]


def welch_difference(
    arm: Sequence[float], baseline: Sequence[float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """``mean(arm) - mean(baseline)`` of two unpaired samples (finite values), with Welch's t interval at
    ``confidence`` and its two-sided p (SciPy's ``ttest_ind`` with ``equal_var=False``); ``n`` the runs of
    ``arm``. nan interval and p with fewer than 2 values on a side."""
    a = [x for x in arm if math.isfinite(x)]
    b = [x for x in baseline if math.isfinite(x)]
    if not a or not b:
        return PairedDifference(math.nan, math.nan, math.nan, math.nan, len(a))
    mean = statistics.mean(a) - statistics.mean(b)
    if len(a) < 2 or len(b) < 2:
        return PairedDifference(mean, math.nan, math.nan, math.nan, len(a))
    test = stats.ttest_ind(a, b, equal_var=False)
    interval = test.confidence_interval(confidence)
    return PairedDifference(mean, float(interval.low), float(interval.high), float(test.pvalue), len(a))
