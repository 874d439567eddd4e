"""Experiment reports: the gradient-control ablation and the learning-speed study (results, tables, plots,
TensorBoard reader)."""
