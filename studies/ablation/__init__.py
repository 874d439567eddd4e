"""The gradient-control ablation (``python -m studies.ablation``; its report: ``studies/ablation/README.md``).

From the bottom up: its arms and conditions (:mod:`~studies.ablation.arms`, the round's configuration in
:mod:`~studies.ablation.family`), a finished run read back and summarised (:mod:`~studies.ablation.runs`),
its numbers (:mod:`~studies.ablation.metrics`), paired differences (:mod:`~studies.stats.paired`,
:mod:`~studies.ablation.compare`), the settings of an invocation (:mod:`~studies.ablation.settings`), runs made
(:mod:`~studies.ablation.execute`), replayed outlier events (:mod:`~studies.ablation.replay`), the plots
(:mod:`~studies.ablation.plots`), the report (:mod:`~studies.ablation.report`), the plan made run by run
(:mod:`~studies.ablation.plan`), the CPU check (:mod:`~studies.ablation.verify`) and the command line
(:mod:`~studies.ablation.cli`)."""
