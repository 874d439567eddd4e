"""The gradient-control ablation (``lstm_transducer_stateless/ablation.py``): its arms and conditions
(:mod:`~studies.ablation.arms`), a finished run read back and summarised (:mod:`~studies.ablation.runs`),
its numbers (:mod:`~studies.ablation.metrics`), paired differences (:mod:`~studies.ablation.paired`,
:mod:`~studies.ablation.compare`), replayed outlier events (:mod:`~studies.ablation.replay`), the RESULTS.md
section (:mod:`~studies.ablation.section`) and plots (:mod:`~studies.ablation.plots`), and the study that
runs them (:mod:`~studies.ablation.study`)."""
