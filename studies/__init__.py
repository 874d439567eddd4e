"""The recipe's studies: experiments that train and decode many runs of the recipe and write their
findings into RESULTS.md. Each imports the library (:mod:`icefall_lite`); nothing in the library imports
them.

* :mod:`studies.runner`: what every study shares: running ``train.py``/``decode.py`` as subprocesses,
  finished results detected from the files they leave, progress and time left, the generated sections
  of RESULTS.md;
* :mod:`studies.tb_reader`: the TensorBoard scalars a training run wrote;
* :mod:`studies.ablation`: the gradient-control ablation (``lstm_transducer_stateless/ablation.py``);
* :mod:`studies.learning_speed`: the learning-speed study (``lstm_transducer_stateless/learning_speed.py``);
* :mod:`studies.learning_curve`: WER against training minutes (``lstm_transducer_stateless/learning_curve.py``).
"""
