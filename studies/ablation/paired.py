"""Paired comparisons over seeds: the mean per-seed difference between two
arms, its 95% confidence interval and p-value (paired t-test), Holm's
step-down adjustment for a family of such comparisons, and the exact
Wilcoxon signed-rank test beside the t-test.

A seed fixes the initialisation and the batch order in every arm, so the
difference ``arm - baseline`` of one seed removes what the seeds share; the
t-test on those differences is the paired t-test. Student's t distribution
is computed here (regularised incomplete beta function, continued fraction
as in Numerical Recipes' ``betacf``) rather than adding SciPy for two
functions. The signed-rank test's p-value is exact: the permutation
distribution of the signed-rank sum over all 2^n sign assignments, counted
by dynamic programming over the ranks.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Sequence

CONFIDENCE = 0.95


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (Lentz's method)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(q: float, df: float) -> float:
    """The ``q``-quantile of Student's t (bisection on the CDF to 1e-12)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if q < 0.5:
        return -student_t_quantile(1.0 - q, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < q:
        high *= 2.0
    while high - low > 1e-12 * max(1.0, high):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if student_t_cdf(mid, df) < q else (low, mid)
    return 0.5 * (low + high)


@dataclass(frozen=True)
class PairedDifference:
    """``arm - baseline`` over paired seeds: mean, the 95% interval, the two-sided p-value, the seeds used."""

    mean: float
    low: float
    high: float
    p: float
    n: int

    def interval(self, digits: int) -> str:
        if self.n < 2:
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


def paired_difference(
    arm: Dict[int, float], baseline: Dict[int, float], confidence: float = CONFIDENCE
) -> PairedDifference:
    """The paired t statistics of ``arm[seed] - baseline[seed]`` over the seeds both have with finite values
    (the interval at ``confidence``).

    With fewer than 2 pairs, the interval and p-value are nan; with differences that are all equal, the
    interval is that value and p is 0 (if it is not 0) or 1.
    """
    diffs = [
        arm[s] - baseline[s]
        for s in sorted(set(arm) & set(baseline))
        if math.isfinite(arm[s]) and math.isfinite(baseline[s])
    ]
    n = len(diffs)
    if n == 0:
        return PairedDifference(math.nan, math.nan, math.nan, math.nan, 0)
    mean = statistics.mean(diffs)
    if n < 2:
        return PairedDifference(mean, math.nan, math.nan, math.nan, n)
    sem = statistics.stdev(diffs) / math.sqrt(n)
    if sem == 0.0:
        return PairedDifference(mean, mean, mean, 1.0 if mean == 0.0 else 0.0, n)
    half = student_t_quantile(0.5 + confidence / 2.0, n - 1) * sem
    p = 2.0 * (1.0 - student_t_cdf(abs(mean) / sem, n - 1))
    return PairedDifference(mean, mean - half, mean + half, min(1.0, p), n)


def holm_adjust(p_values: Sequence[float]) -> List[float]:
    """Holm's step-down adjusted p-values, in the input order (nan stays nan and is not counted).

    Reject comparison i at family-wise level alpha when its adjusted p is at most alpha.
    """
    order = sorted((p, i) for i, p in enumerate(p_values) if math.isfinite(p))
    m = len(order)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class SignedRank:
    """The Wilcoxon signed-rank test of paired differences: the non-zero differences used, the sum of the
    ranks of the positive ones, and the exact two-sided p-value (nan without a non-zero difference)."""

    n: int
    w_plus: float
    p: float


def mid_ranks(xs: Sequence[float]) -> List[float]:
    """Ranks 1..n of ``xs`` (ascending), ties at the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def signed_rank_test(differences: Sequence[float]) -> SignedRank:
    """The exact two-sided Wilcoxon signed-rank test of ``differences`` (finite ones).

    Zero differences are dropped (Wilcoxon's rule); tied absolute values take the mean of their ranks. Under
    the null every sign assignment of the ranks is equally likely: the p-value is the share of the 2^n
    assignments whose rank sum of positives is at least as far from its mean, n(n + 1) / 4, as the observed
    one. The distribution is counted exactly on doubled ranks (integers, ties included).
    """
    xs = [d for d in differences if math.isfinite(d) and d != 0.0]
    n = len(xs)
    if n == 0:
        return SignedRank(0, 0.0, math.nan)
    doubled = [int(round(2 * r)) for r in mid_ranks([abs(d) for d in xs])]
    observed = sum(r for r, d in zip(doubled, xs) if d > 0)
    counts = {0: 1}
    for r in doubled:
        grown = dict(counts)
        for total, ways in counts.items():
            grown[total + r] = grown.get(total + r, 0) + ways
        counts = grown
    centre2 = sum(doubled)  # twice the mean of the doubled sum: compare 2 x |sum - mean| in integers
    distance = abs(2 * observed - centre2)
    extreme = sum(ways for total, ways in counts.items() if abs(2 * total - centre2) >= distance)
    return SignedRank(n, observed / 2.0, min(1.0, extreme / 2**n))


def smallest_signed_rank_p(n: int) -> float:
    """The smallest two-sided p-value the exact signed-rank test can give with ``n`` non-zero differences
    (all of one sign, no ties): 2 / 2^n (1 with none)."""
    return 1.0 if n == 0 else min(1.0, 2.0 / 2**n)
