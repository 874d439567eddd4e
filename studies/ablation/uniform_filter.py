"""Replay branch (e): the GradientFilter's mean scale applied uniformly, with no per-sequence capping.

In backward, icefall's GradientFilter scales the gradient of sequence ``b`` by ``c / (c + n_b)`` (``n_b`` its
RMS, ``c`` the threshold times the batch median of ``n``): the outlier is capped near ``c``, every other
sequence shrunk a little; the parameter gradients are scaled by ``1 / (1 + mean(n) / c)``. The uniform
filter computes the same factors at every step and applies their mean, ``mean_b c / (c + n_b)``, to every
sequence alike (the parameter gradients as the filter does): the same step-by-step shrinking, no capping. A
replay branch trained with it tells what filtering does beyond a transient cut of the step size.

Run as ``python -m studies.ablation.uniform_filter <path of train.py> <train.py's flags>``: train.py itself
(its flags, data, loop, checkpoints and logs), with every LSTM layer's GradientFilter (``--grad-filter-threshold
T``, T finite) swapped for a :class:`UniformGradientFilter` of the same threshold right after the model is
built. Nothing of train.py or the library changes.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.nn.clip import GradientFilterStats
from icefall_lite.train.checkpoint import unwrap


class _UniformFilterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, batch_dim: int, threshold: float, stats: GradientFilterStats, *params: Tensor):
        ctx.batch_dim, ctx.threshold, ctx.stats = batch_dim, threshold, stats
        return (x.view_as(x),) + tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, x_grad: Tensor, *param_grads: Tensor):
        batch_dim = ctx.batch_dim % x_grad.ndim
        dims = [d for d in range(x_grad.ndim) if d != batch_dim]
        norm = x_grad.to(torch.promote_types(x_grad.dtype, torch.float32)).square().mean(dim=dims).sqrt()
        median = norm.median()
        cutoff = median * ctx.threshold
        if float(cutoff) > 0:
            factors = cutoff / (cutoff + norm)  # the filter's per-sequence factors
            mean_factor = factors.mean()
            param_scale = 1.0 / (1.0 + norm.mean() / cutoff)
        else:  # as the filter: a zero median gradient filters nothing
            mean_factor = param_scale = torch.ones_like(median)
        ctx.stats.update(norm, median, cutoff, param_scale)
        scaled = tuple(g * param_scale.to(g.dtype) for g in param_grads)
        return (x_grad * mean_factor.to(x_grad.dtype), None, None, None) + scaled


class UniformGradientFilter(nn.Module):
    """The GradientFilter's mean scale for every sequence (see the module doc); identity in forward, the
    filter's statistics in :attr:`stats` (``fraction_filtered``: the sequences above the cutoff, which the
    filter would cap and this one does not)."""

    mode = "uniform"

    def __init__(self, batch_dim: int, threshold: float) -> None:
        super().__init__()
        if not 0 < threshold < math.inf:
            raise ValueError(f"UniformGradientFilter needs a finite threshold > 0, got {threshold}")
        self.batch_dim = batch_dim
        self.threshold = float(threshold)
        self.stats = GradientFilterStats()

    def forward(self, x: Tensor, *params: Tensor) -> Tuple[Tensor, ...]:
        if not torch.is_grad_enabled():
            return (x,) + tuple(params)
        return _UniformFilterFunction.apply(x, self.batch_dim, self.threshold, self.stats, *params)

    def extra_repr(self) -> str:
        return f"batch_dim={self.batch_dim}, threshold={self.threshold}, uniform"


def make_uniform(model: nn.Module) -> List[int]:
    """Swap every encoder layer's GradientFilter for a uniform one of the same threshold; returns the layers.

    Raises:
      ValueError: the model has no GradientFilter with a finite threshold (train.py needs
        ``--grad-filter-threshold T``, T finite).
    """
    swapped = []
    for i, layer in enumerate(unwrap(model).encoder.encoder.layers):
        old = layer.lstm.grad_filter
        if old is not None and math.isfinite(old.threshold):
            layer.lstm.grad_filter = UniformGradientFilter(old.batch_dim, old.threshold)
            swapped.append(i)
    if not swapped:
        raise ValueError("no GradientFilter with a finite threshold to make uniform: pass --grad-filter-threshold T")
    return swapped


def load_train_script(path: Path):
    """train.py as a module (not run)."""
    spec = importlib.util.spec_from_file_location("uniform_filter_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        sys.exit("usage: python -m studies.ablation.uniform_filter <path of train.py> <train.py's flags>")
    train = load_train_script(Path(argv[0]))
    build_models = train.build_models

    def build_uniform(*args, **kwargs):
        model, model_avg = build_models(*args, **kwargs)
        layers = make_uniform(model)
        logging.info(f"Uniform filter (studies.ablation.uniform_filter) in encoder layers {layers}")
        return model, model_avg

    train.build_models = build_uniform
    sys.argv = [argv[0], *argv[1:]]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train.main()


if __name__ == "__main__":
    main()
