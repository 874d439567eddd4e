"""Paired comparisons (studies/stats/paired.py: SciPy's t-test and signed-rank test, statsmodels' Holm) and the
power of the paired t-test (studies/stats/power.py: statsmodels' TTestPower), each against the hand-written
versions the study computed them with before (kept here only as oracles: Student's t by the incomplete beta
function, Holm by its definition, the signed-rank null counted exactly over doubled mid-ranks, the noncentral t
by Simpson's rule), and those oracles and the new functions against closed forms, printed tables, hand-worked
cases and a brute-force enumeration of the sign patterns."""

import itertools
import math
import random
import statistics
from typing import Dict, List, Sequence

import pytest
from statsmodels.stats.power import TTestPower

from studies.stats.paired import (
    PairedDifference,
    SignedRank,
    holm_adjust,
    mid_ranks,
    paired_difference,
    seed_differences,
    signed_rank_test,
    smallest_signed_rank_p,
)
from studies.stats.power import effect_for_power, paired_t_power, pairs_for_power

# --------------------------------------------------------------------------
# The oracles: the study's hand-written statistics, as they were before SciPy and statsmodels replaced them
# --------------------------------------------------------------------------


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


def oracle_paired_difference(
    arm: Dict[int, float], baseline: Dict[int, float], confidence: float = 0.95
) -> PairedDifference:
    """The paired t statistics of ``arm[seed] - baseline[seed]`` over the seeds both have with finite values
    (the interval at ``confidence``).

    With fewer than 2 pairs, the interval and p-value are nan; with differences that are all equal, the
    interval is that value and p is 0 (if it is not 0) or 1.
    """
    diffs = seed_differences(arm, baseline)  # the pairing, shared: the oracle checks the statistics
    n = len(diffs)
    mean = statistics.mean(diffs) if n else math.nan
    if n < 2:
        return PairedDifference(mean, math.nan, math.nan, math.nan, n)
    sem = statistics.stdev(diffs) / math.sqrt(n)
    if sem == 0.0:
        return PairedDifference(mean, mean, mean, 1.0 if mean == 0.0 else 0.0, n)
    half = student_t_quantile(0.5 + confidence / 2.0, n - 1) * sem
    p = 2.0 * (1.0 - student_t_cdf(abs(mean) / sem, n - 1))
    return PairedDifference(mean, mean - half, mean + half, min(1.0, p), n)


def oracle_holm_adjust(p_values: Sequence[float]) -> List[float]:
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


def oracle_mid_ranks(xs: Sequence[float]) -> List[float]:
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


def oracle_signed_rank_test(differences: Sequence[float]) -> SignedRank:
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
    doubled = [int(round(2 * r)) for r in oracle_mid_ranks([abs(d) for d in xs])]
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


_SIMPSON_INTERVALS = 4000  # even


def _normal_sf(x: float) -> float:
    """P(Z > x) for a standard normal Z."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def _chi_over_sqrt_nu_logpdf(u: float, nu: float) -> float:
    """log density of ``U = sqrt(V / nu)``, ``V`` chi-square with ``nu`` degrees of freedom, at ``u > 0``."""
    return (
        math.log(2.0)
        + (nu / 2.0) * math.log(nu / 2.0)
        - math.lgamma(nu / 2.0)
        + (nu - 1.0) * math.log(u)
        - nu * u * u / 2.0
    )


def noncentral_t_sf(c: float, df: float, noncentrality: float) -> float:
    """P(T > c) for the noncentral t with ``df`` degrees of freedom and the given noncentrality."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    # U concentrates around 1 with standard deviation about 1 / sqrt(2 df): integrate over (0, upper].
    upper = 1.0 + 12.0 / math.sqrt(2.0 * df) + 2.0
    h = upper / _SIMPSON_INTERVALS
    total = 0.0
    for i in range(1, _SIMPSON_INTERVALS + 1):  # the density is 0 at u = 0 for df > 1 (and bounded for df = 1)
        u = i * h
        weight = 1.0 if i == _SIMPSON_INTERVALS else (4.0 if i % 2 else 2.0)
        total += weight * math.exp(_chi_over_sqrt_nu_logpdf(u, df)) * _normal_sf(c * u - noncentrality)
    if df == 1.0:
        # The endpoint u = 0: the density is 0 there for df > 1, sqrt(2 / pi) for df = 1.
        total += math.sqrt(2.0 / math.pi) * _normal_sf(-noncentrality)
    return min(1.0, max(0.0, total * h / 3.0))


def oracle_paired_t_power(effect: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` pairs, for a true standardised effect
    ``effect = mean / standard deviation`` of the differences (``n`` >= 2, 0 < ``alpha`` < 1)."""
    df = n - 1
    critical = student_t_quantile(1.0 - alpha / 2.0, df)
    lam = math.sqrt(n) * effect
    return noncentral_t_sf(critical, df, lam) + noncentral_t_sf(critical, df, -lam)


def oracle_effect_for_power(n: int, alpha: float, target: float) -> float:
    """The smallest standardised effect (mean / standard deviation of the differences) at which the two-sided
    paired t-test with ``n`` pairs at level ``alpha`` reaches ``target`` power: what a null at ``n`` pairs
    leaves possible. The power grows with the effect: bisection on the effect, to 1e-6."""
    if not alpha < target < 1.0:
        raise ValueError(f"the target power must be in (alpha, 1) = ({alpha:g}, 1), got {target}")
    low, high = 0.0, 1.0
    while oracle_paired_t_power(high, n, alpha) < target:
        high *= 2.0
    while high - low > 1e-6:
        mid = (low + high) / 2.0
        low, high = (mid, high) if oracle_paired_t_power(mid, n, alpha) < target else (low, mid)
    return high


# --------------------------------------------------------------------------
# The oracles against closed forms and tables
# --------------------------------------------------------------------------


@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 1.7, 4.0, 250.0])
def test_t_cdf_matches_the_closed_forms(t):
    assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)  # Cauchy
    assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)


def test_t_quantiles_match_the_tables():
    # Two-sided 95% critical values from any t table.
    for df, value in ((1, 12.7062047362), (2, 4.3026527297), (4, 2.7764451052), (10, 2.2281388520), (30, 2.0422724563)):
        assert student_t_quantile(0.975, df) == pytest.approx(value, rel=1e-9)
    assert student_t_quantile(0.025, 4) == pytest.approx(-2.7764451052, rel=1e-9)
    assert student_t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-11)
    with pytest.raises(ValueError, match="quantile must be in"):
        student_t_quantile(1.0, 3)


def test_incomplete_beta_edges_and_a_closed_form():
    assert regularized_incomplete_beta(2.0, 3.0, 0.0) == 0.0 and regularized_incomplete_beta(2.0, 3.0, 1.0) == 1.0
    # I_x(1, b) = 1 - (1 - x)^b
    for x in (0.1, 0.5, 0.93):
        assert regularized_incomplete_beta(1.0, 3.5, x) == pytest.approx(1 - (1 - x) ** 3.5, rel=1e-12)


def test_noncentral_t_is_central_t_at_zero_noncentrality():
    for df in (1, 2, 4, 16):
        for c in (0.5, 2.0, 4.0):
            assert noncentral_t_sf(c, df, 0.0) == pytest.approx(1.0 - student_t_cdf(c, df), abs=1e-9), (df, c)
    assert oracle_paired_t_power(0.0, 10, 0.05) == pytest.approx(0.05, abs=1e-9), "power at no effect is alpha"


# --------------------------------------------------------------------------
# SciPy and statsmodels against the oracles
# --------------------------------------------------------------------------


def _random_pairs(rng: random.Random, n: int):
    """WERs at 2 decimals, as the runs report them: differences tie often."""
    return (
        {s: round(rng.gauss(8.0, 1.0), 2) for s in range(n)},
        {s: round(rng.gauss(8.0, 1.0), 2) for s in range(n)},
    )


def test_the_paired_t_test_agrees_with_the_hand_written_one():
    rng = random.Random(5)
    for n in [2, 3, 5, 17] * 10:
        arm, base = _random_pairs(rng, n)
        for confidence in (0.95, 0.9):
            new, old = paired_difference(arm, base, confidence), oracle_paired_difference(arm, base, confidence)
            assert new.n == old.n and new.mean == old.mean
            for field in ("low", "high", "p"):
                assert getattr(new, field) == pytest.approx(getattr(old, field), abs=1e-10), (field, arm, base)
    for arm, base in (({1: 2.0, 2: 3.0}, {1: 1.0, 2: 2.0}), ({1: 2.0}, {1: 1.0}), ({1: math.nan}, {1: 1.0})):
        new, old = paired_difference(arm, base), oracle_paired_difference(arm, base)
        assert repr(new) == repr(old), "the edge cases (one pair, equal differences, none) as before"


def test_holm_agrees_with_its_definition():
    rng = random.Random(6)
    for _ in range(40):
        ps = [rng.random() ** 3 for _ in range(rng.randint(1, 10))] + [math.nan]
        rng.shuffle(ps)
        new, old = holm_adjust(ps), oracle_holm_adjust(ps)
        assert [math.isnan(p) for p in new] == [math.isnan(p) for p in old]
        assert [p for p in new if p == p] == pytest.approx([p for p in old if p == p], abs=1e-15)


def test_the_signed_rank_test_agrees_exactly_with_the_hand_written_one():
    rng = random.Random(7)
    for n in [1, 2, 3, 5, 8, 12, 17] * 2:
        arm, base = _random_pairs(rng, n)
        diffs = [arm[s] - base[s] for s in range(n)]
        diffs[0] = 0.0 if n > 3 else diffs[0]  # a zero difference, dropped
        diffs[-1] = -diffs[1] if n > 4 else diffs[-1]  # tied magnitudes
        assert signed_rank_test(diffs) == oracle_signed_rank_test(diffs), diffs
    assert mid_ranks([3.0, 1.0, 3.0, 2.0]) == oracle_mid_ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]


@pytest.mark.parametrize("n", [2, 3, 5, 10, 17, 40])
def test_the_power_agrees_with_the_noncentral_t_by_simpsons_rule(n):
    # With 1 degree of freedom the oracle's integrand does not vanish at 0 and Simpson's rule is off by up to
    # 5e-7 there (SciPy and statsmodels agree with each other to 1e-16); from 2 degrees of freedom on, 1e-10.
    tolerance = 1e-6 if n == 2 else 1e-10
    for effect in (0.0, 0.3, 0.952, -0.7, 2.0, 5.0):
        for alpha in (0.05, 0.01, 0.005):
            new, old = paired_t_power(effect, n, alpha), oracle_paired_t_power(effect, n, alpha)
            assert new == pytest.approx(old, abs=tolerance), (effect, alpha)
            theirs = TTestPower().power(effect_size=effect, nobs=n, alpha=alpha, alternative="two-sided")
            if math.isfinite(theirs):  # statsmodels' lower tail is nan where it vanishes (power.py says where)
                assert new == pytest.approx(theirs, abs=1e-12), (effect, alpha)
    assert paired_t_power(0.0, n, 0.05) == pytest.approx(0.05, abs=1e-12), "power at no effect is alpha"
    assert pairs_for_power(0.952, 0.01, 0.8) == min(
        n for n in range(2, 201) if oracle_paired_t_power(0.952, n, 0.01) >= 0.8
    )
    assert pairs_for_power(0.952, 0.01, 0.8) == 17
    for alpha in (0.05, 0.005):
        # The oracle bisects the effect to 1e-6 and returns the upper end.
        assert effect_for_power(n, alpha, 0.8) == pytest.approx(oracle_effect_for_power(n, alpha, 0.8), abs=2e-6)
    # Where statsmodels' solve_power missed the root (power.py): 5 pairs at alpha 0.005 reach 80% at 3.155.
    assert effect_for_power(5, 0.005, 0.8) == pytest.approx(3.1553488, abs=1e-6)


# --------------------------------------------------------------------------
# SciPy and statsmodels against hand-worked cases
# --------------------------------------------------------------------------


def test_paired_difference_by_hand():
    arm = {1: 11.0, 2: 12.0, 3: 14.0, 9: 1.0}
    base = {1: 10.0, 2: 10.0, 3: 10.0, 5: 3.0}  # seeds 9 and 5 have no partner
    d = paired_difference(arm, base)
    diffs = [1.0, 2.0, 4.0]
    mean, sem = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(3)
    assert d.n == 3 and d.mean == pytest.approx(mean)
    assert (d.low, d.high) == (pytest.approx(mean - 4.3026527297 * sem), pytest.approx(mean + 4.3026527297 * sem))
    t = mean / sem
    assert d.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)  # 2 (1 - F_2(t))
    assert d.interval(2) == f"[{mean - 4.3026527297 * sem:+.2f}, {mean + 4.3026527297 * sem:+.2f}]"
    same = paired_difference({1: 2.0, 2: 3.0}, {1: 1.0, 2: 2.0})
    assert (same.mean, same.low, same.high, same.p) == (1.0, 1.0, 1.0, 0.0)
    one = paired_difference({1: 2.0}, {1: 1.0})
    assert one.mean == 1.0 and math.isnan(one.p) and one.interval(2) == "-"
    assert paired_difference({1: float("nan")}, {1: 1.0}).n == 0


def test_holm_adjust_by_definition():
    ps = [0.01, 0.04, 0.03, 0.005, float("nan")]
    # sorted: 0.005 (x4), 0.01 (x3), 0.03 (x2), 0.04 (x1), each at least the one before
    assert holm_adjust(ps)[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert math.isnan(holm_adjust(ps)[4])
    assert holm_adjust([0.6, 0.9]) == [1.0, 1.0]
    assert holm_adjust([]) == []


def _signed_rank_brute_force(diffs):
    """The exact two-sided signed-rank p by enumerating all 2^n sign patterns of the (mid-)ranks."""
    xs = [d for d in diffs if d != 0]
    absolute = sorted(abs(d) for d in xs)
    ranks = [statistics.mean(i + 1 for i, a in enumerate(absolute) if a == abs(d)) for d in xs]
    observed = sum(r for r, d in zip(ranks, xs) if d > 0)
    mean = sum(ranks) / 2
    extreme = sum(
        1
        for signs in itertools.product((0, 1), repeat=len(xs))
        if abs(sum(r for r, s in zip(ranks, signs) if s) - mean) >= abs(observed - mean) - 1e-9
    )
    return extreme / 2 ** len(xs)


def test_signed_rank_by_hand():
    # Five positive differences: W+ = 15, only "all +" and "all -" are as extreme: 2 / 32.
    t = signed_rank_test([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (t.n, t.w_plus, t.p) == (5, 15.0, 2 / 32)
    # One negative at rank 1: W+ = 14; as far from the mean 7.5: W+ in {14, 15} or {0, 1}: 4 / 32.
    assert signed_rank_test([-1.0, 2.0, 3.0, 4.0, 5.0]).p == 4 / 32
    # Ties: |1| twice at mid-rank 1.5, |2| at 3: W+ = 4.5, mean 3; sums 0, 1.5, 1.5, 3, 3, 4.5, 4.5, 6 -> 6 of 8.
    t = signed_rank_test([1.0, -1.0, 2.0])
    assert (t.w_plus, t.p) == (4.5, 6 / 8)
    # Zeros are dropped (Wilcoxon): two positives left, 2 of 4 patterns as extreme.
    t = signed_rank_test([0.0, 1.0, 2.0])
    assert (t.n, t.p) == (2, 0.5)
    assert math.isnan(signed_rank_test([0.0, float("nan")]).p)
    assert smallest_signed_rank_p(5) == 0.0625 and smallest_signed_rank_p(6) == 2 / 64


def test_signed_rank_against_brute_force_enumeration():
    rng = random.Random(3)
    for n in range(1, 11):
        for _ in range(8):
            diffs = [rng.choice([-3, -2, -1, -0.5, 0, 0.5, 1, 2, 3, 4]) for _ in range(n)]
            if not any(diffs):
                continue
            assert signed_rank_test(diffs).p == pytest.approx(_signed_rank_brute_force(diffs), abs=1e-12), diffs


def test_paired_difference_at_another_confidence():
    d = paired_difference({1: 3.0, 2: 5.0, 3: 4.0}, {1: 1.0, 2: 2.0, 3: 2.0}, confidence=0.9)
    sem = statistics.stdev([2.0, 3.0, 2.0]) / math.sqrt(3)
    assert d.high - d.mean == pytest.approx(2.9199855804 * sem, rel=1e-9)  # t(0.95, df 2)
