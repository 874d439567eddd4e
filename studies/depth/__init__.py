"""Where gradient outliers arise as the LSTM stack deepens: the depth pilot. Its report is this folder's
README.md (tables from the pilot's run summaries, the plot depth-outliers.png).

* :mod:`studies.depth.report`: the tables and the plot from the ablation's run summaries of one arm at several
  depths, ``python -m studies.depth``;
* ``pilot.sh``: the pilot's runs (the ablation's ``none`` arm, one seed, one process per model) and the report.
"""
