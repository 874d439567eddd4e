"""The learning-speed study: which settings make the default model learn fastest on 2 CPU cores, and the
learning curves of the demo's model under the defaults before and after it. Its report is this folder's
README.md.

* :mod:`studies.learning_speed.arms`: the arms (one change each from the defaults of 2026-11-23) and their
  train.py / decode.py commands;
* :mod:`studies.learning_speed.run`: one arm run from scratch and read back (its done file);
* :mod:`studies.learning_speed.report`: the README's generated section from the finished arms;
* :mod:`studies.learning_speed.study`: the command line, ``python -m studies.learning_speed``;
* :mod:`studies.learning_speed.curve`: WER against training minutes, ``python -m studies.learning_speed.curve``
  (learning-curve.png and .csv here).
"""
