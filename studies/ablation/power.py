"""The power of the paired t-test, for choosing how many paired seeds a comparison needs.

With ``n`` pairs whose differences have mean ``mu`` and standard deviation ``sigma``, the paired t statistic
follows the noncentral t distribution with ``n - 1`` degrees of freedom and noncentrality
``lambda = sqrt(n) mu / sigma``. The two-sided test at level ``alpha`` rejects when ``|T| > t_c``, ``t_c`` the
``1 - alpha / 2`` quantile of Student's t, so its power is ``P(T > t_c) + P(T < -t_c)``.

``T = (Z + lambda) / U`` with ``Z`` standard normal and ``U = sqrt(V / nu)``, ``V`` chi-square with ``nu``
degrees of freedom, independent; conditioning on ``U``,
``P(T > c) = E[1 - Phi(c U - lambda)]``, an integral over the density of ``U`` computed here by Simpson's
rule (no SciPy). Under Holm's adjustment over ``m`` comparisons a comparison is rejected for sure only when
its p-value is at most ``alpha / m`` (the first step), so the power under Holm is taken at ``alpha / m``: a
lower bound.
"""

from __future__ import annotations

import math

from studies.ablation.paired import student_t_quantile

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


def paired_t_power(effect: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` pairs, for a true standardised effect
    ``effect = mean / standard deviation`` of the differences."""
    if n < 2:
        raise ValueError(f"the paired t-test needs at least 2 pairs, got {n}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    df = n - 1
    critical = student_t_quantile(1.0 - alpha / 2.0, df)
    lam = math.sqrt(n) * effect
    return noncentral_t_sf(critical, df, lam) + noncentral_t_sf(critical, df, -lam)


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
    leaves possible. The power grows with the effect: bisection on the effect, to 1e-6."""
    if not alpha < target < 1.0:
        raise ValueError(f"the target power must be in (alpha, 1) = ({alpha:g}, 1), got {target}")
    low, high = 0.0, 1.0
    while paired_t_power(high, n, alpha) < target:
        high *= 2.0
    while high - low > 1e-6:
        mid = (low + high) / 2.0
        low, high = (mid, high) if paired_t_power(mid, n, alpha) < target else (low, mid)
    return high
