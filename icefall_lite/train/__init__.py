"""Training machinery: optimizers and learning-rate schedulers, checkpoints and averaging, diagnostics."""
