"""The power of the paired t-test, for choosing how many paired seeds a comparison needs (SciPy's noncentral t).

With ``n`` pairs whose differences have mean ``mu`` and standard deviation ``sigma``, the paired t statistic
follows the noncentral t distribution with ``n - 1`` degrees of freedom and noncentrality
``lambda = sqrt(n) mu / sigma``. The two-sided test at level ``alpha`` rejects when ``|T| > t_c``, ``t_c``
Student's ``1 - alpha / 2`` quantile, so its power is ``P(T > t_c | lambda) + P(T > t_c | -lambda)`` (the lower
tail by symmetry). Under Holm's adjustment over ``m`` comparisons a comparison is rejected for sure only when its
p-value is at most ``alpha / m`` (the first step), so the power under Holm is taken at ``alpha / m``: a lower
bound.

Not statsmodels' ``TTestPower``, which computes the same sum with the lower tail as SciPy's ``nct.cdf(-t_c)``:
that returns nan where the tail is vanishingly small (5 pairs at effect 5, 17 pairs at effect 2 and alpha
0.01), and its ``solve_power`` returned 3.09 for the effect that 5 pairs reach 80% power with at alpha 0.005
(power 0.78 there; the root is 3.155). ``tests/test_paired.py`` checks this module against ``TTestPower`` where
that is finite.
"""

from __future__ import annotations

import math

from scipy import optimize, stats


def paired_t_power(effect: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` pairs, for a true standardised effect
    ``effect = mean / standard deviation`` of the differences."""
    if n < 2:
        raise ValueError(f"the paired t-test needs at least 2 pairs, got {n}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    df = n - 1
    critical = stats.t.ppf(1.0 - alpha / 2.0, df)
    lam = math.sqrt(n) * effect
    return float(stats.nct.sf(critical, df, lam) + stats.nct.sf(critical, df, -lam))


def pairs_for_power(effect: float, alpha: float, target: float, most: int = 200) -> int:
    """The fewest pairs (at least 2) whose paired t-test reaches ``target`` power at ``effect`` and ``alpha``.

    Raises:
      ValueError: not reached with ``most`` pairs (a zero effect never is).
    """
    for n in range(2, most + 1):
        if paired_t_power(effect, n, alpha) >= target:
            return n
    raise ValueError(f"power {target} at effect {effect:g} and alpha {alpha:g} needs more than {most} pairs")


def effect_for_power(n: int, alpha: float, target: float) -> float:
    """The smallest standardised effect (mean / standard deviation of the differences) at which the two-sided
    paired t-test with ``n`` pairs at level ``alpha`` reaches ``target`` power: what a null at ``n`` pairs
    leaves possible. The power grows with the effect: Brent's method on ``power - target``, bracketed from
    ``[0, 1]`` by doubling."""
    if not alpha < target < 1.0:
        raise ValueError(f"the target power must be in (alpha, 1) = ({alpha:g}, 1), got {target}")
    high = 1.0
    while paired_t_power(high, n, alpha) < target:
        high *= 2.0
    return float(optimize.brentq(lambda e: paired_t_power(e, n, alpha) - target, 0.0, high, xtol=1e-12))


def minimum_detectable_effect(sd: float, n: int, alpha: float, target: float) -> float:
    """The smallest true mean difference, in the differences' own units, that the two-sided paired t-test with
    ``n`` pairs at level ``alpha`` detects with ``target`` power when the per-seed differences have standard
    deviation ``sd``: ``sd`` times :func:`effect_for_power`."""
    return sd * effect_for_power(n, alpha, target)
