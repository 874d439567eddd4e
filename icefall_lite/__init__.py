"""icefall-lite: an LSTM transducer recipe in the icefall tradition, in plain PyTorch.

Subpackages, each importing only from those listed before it (and ``utils``
and ``recipe_defaults``):

* :mod:`icefall_lite.nn`: the model and its losses (gradient control, scaled
  modules, pruned RNN-T loss, encoder, decoder, joiner, transducer);
* :mod:`icefall_lite.data`: lhotse datamodule, features, manifests, BPE,
  corruption; the synthetic corpus under :mod:`icefall_lite.data.synthetic`;
* :mod:`icefall_lite.train`: the training loop (loss, gradient control, step,
  epochs, resumption, TensorBoard tags), optimizers and schedulers,
  checkpoints and averaging, diagnostics;
* :mod:`icefall_lite.decoding`: searches, decoding plumbing, streaming, WER files;
* :mod:`icefall_lite.export`: scaled-to-plain conversion, ONNX, sherpa-onnx.

The recipe's studies (the gradient-control ablation, the learning-speed
study) are the package ``studies`` beside this one: they import the library,
nothing here imports them.

Each public name has one import path, the module that defines it (README,
"5. The library", lists them).
"""
