"""The recipe's studies: experiments that train and decode many runs of the recipe, each in a package of its
own with its command line (``python -m studies.<name>``), its run summaries and its report (its README.md).
Each imports the library (:mod:`icefall_lite`); nothing in the library imports them.

* :mod:`studies.runner`: what every study shares: running ``train.py``/``decode.py`` as subprocesses,
  finished results detected from the files they leave, progress and time left, the machine of a run,
  generated sections of a report;
* :mod:`studies.tb_reader`: the TensorBoard scalars a training run wrote;
* :mod:`studies.ablation`: the gradient-control ablation (``python -m studies.ablation``);
* :mod:`studies.depth`: the depth pilot's report (``python -m studies.depth``);
* :mod:`studies.learning_speed`: the learning-speed study and the learning curve
  (``python -m studies.learning_speed``, ``python -m studies.learning_speed.curve``).
"""
