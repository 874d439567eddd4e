"""Paired comparisons: Student's t against closed forms (1 and 2 degrees of freedom) and printed tables, the
paired difference against a hand-worked case, Holm's adjustment against its definition."""

import math
import statistics

import pytest

from studies.ablation.paired import (
    holm_adjust,
    paired_difference,
    regularized_incomplete_beta,
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
