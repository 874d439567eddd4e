"""Where the GradientFilter has work to do: training on digits with outlier utterances (a fraction of the
training cuts corrupted) and in unstable settings (a higher learning rate, no warm-up, 12 layers).

A pilot of the ``none`` arm over the grid (:mod:`studies.regime.grid`) picks the cell where training without
any gradient control is hurt most while it still learns (the rule is fixed in ``pilot.json`` before its runs);
its report is this folder's README.md. Run it with ``python -m studies.regime`` from the repository.
"""
