"""Paired comparisons: Student's t against closed forms (1 and 2 degrees of freedom) and printed tables, the
paired difference against a hand-worked case, Holm's adjustment against its definition, the exact signed-rank
test against hand-worked cases and a brute-force enumeration of the sign patterns."""

import itertools
import math
import random
import statistics

import pytest

from studies.ablation.paired import (
    holm_adjust,
    paired_difference,
    regularized_incomplete_beta,
    signed_rank_test,
    smallest_signed_rank_p,
    student_t_cdf,
    student_t_quantile,
)


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
