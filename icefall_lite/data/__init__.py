"""Data: the lhotse datamodule, features, manifests, BPE, text normalisation, corruption; the synthetic corpus
in :mod:`icefall_lite.data.synthetic`."""
