"""The studies' statistics, from SciPy and statsmodels: paired differences over seeds with Holm's adjustment
and the exact signed-rank test (:mod:`studies.stats.paired`), and the paired t-test's power
(:mod:`studies.stats.power`)."""
