"""The figures the ablation report's prose states, each checked against a hand-worked example."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from studies.ablation.power import effect_for_power, minimum_detectable_effect, paired_t_power


def test_minimum_detectable_effect_is_the_spread_times_the_standardised_effect():
    # Differences 1, 2, 3: sd 1. With 3 pairs at alpha 0.05 the effect reaching power 0.8 is d; the minimum
    # detectable effect at sd 1 is d points, at sd 2 twice that.
    sd = statistics.stdev([1.0, 2.0, 3.0])
    assert sd == 1.0
    d = effect_for_power(3, 0.05, 0.8)
    assert paired_t_power(d, 3, 0.05) == pytest.approx(0.8, abs=1e-9)
    assert minimum_detectable_effect(sd, 3, 0.05, 0.8) == pytest.approx(d)
    assert minimum_detectable_effect(2.0, 3, 0.05, 0.8) == pytest.approx(2 * d)


def test_minimum_detectable_effect_by_hand_at_many_pairs():
    # With many pairs the noncentral t is nearly normal: effect ~ (z_{1-a/2} + z_{power}) / sqrt(n).
    n, sd = 400, 1.5
    by_hand = sd * (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) / math.sqrt(n)
    assert minimum_detectable_effect(sd, n, 0.05, 0.8) == pytest.approx(by_hand, rel=0.01)


def test_icefall_gain_as_a_share_of_its_baseline_scaled_to_the_baseline_here():
    from studies.ablation.report.answer import relative_gain_here

    # -0.2 of 10 is -2%; -2% of 5 is -0.1.
    relative, here = relative_gain_here(-0.2, 10.0, 5.0)
    assert relative == pytest.approx(-0.02) and here == pytest.approx(-0.1)


def test_pairs_needed_at_a_textbook_effect():
    from studies.ablation.power import pairs_for_power

    # The paired t at d = 0.5, alpha 0.05 two-sided, power 0.8 needs 34 pairs (Cohen's tables; G*Power).
    assert pairs_for_power(0.5, 0.05, 0.8) == 34
