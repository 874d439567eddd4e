"""Clips that act on one tensor's gradient while backward runs, before it flows into the ops that produced
the tensor (the GradientFilter, the third of them, is :mod:`icefall_lite.nn.clip.filter`):

- :class:`ErrorClipByValue`, :func:`error_clip`, :func:`add_error_clip`:
  PaddlePaddle's error clip on a variable's gradient;
- :func:`recurrent_grad_clip`: Kaldi nnet3's per-frame cap on the derivative
  that flows back along a recurrent connection (BackpropTruncationComponent);
- :class:`ClipCounts`: how many items either changed in the last backward.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

Tensor = torch.Tensor


class ErrorClipByValue:
    """Clamp a back-propagated error (gradient) into ``[min, max]``; ``min`` defaults to ``-max``."""

    def __init__(self, max: float, min: Optional[float] = None) -> None:
        self.max = float(max)
        self.min = -self.max if min is None else float(min)
        if not self.min <= self.max:
            raise ValueError(f"ErrorClipByValue needs min <= max, got min={self.min}, max={self.max}")

    def __call__(self, grad: Tensor) -> Tensor:
        return grad.clamp(min=self.min, max=self.max)

    def __repr__(self) -> str:
        return f"ErrorClipByValue(max={self.max}, min={self.min})"


class _ErrorClipFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, clip: Callable[[Tensor], Tensor], counts: Optional[ClipCounts]) -> Tensor:
        ctx.clip, ctx.counts = clip, counts
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        clipped = ctx.clip(grad)
        if ctx.counts is not None:
            ctx.counts.add(((clipped != grad) & (grad == grad)).sum(), grad.numel())  # a NaN is not clipped
        return clipped, None, None


def error_clip(tensor: Tensor, clip: Callable[[Tensor], Tensor], counts: Optional[ClipCounts] = None) -> Tensor:
    """Return ``tensor`` unchanged; in backward, ``clip`` is applied to its gradient.

    The gradient arriving at the returned tensor (summed over all its uses) is
    clipped before it flows into the ops that produced ``tensor``, so every
    upstream gradient is computed from the clipped one. ``counts`` (optional)
    adds the elements the clip changed.
    """
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        return tensor
    return _ErrorClipFunction.apply(tensor, clip, counts)


def add_error_clip(
    module: nn.Module, clip: Callable[[Tensor], Tensor], counts: Optional[ClipCounts] = None
) -> torch.utils.hooks.RemovableHandle:
    """Mark a module's output (a tensor, or each tensor of a tuple output) with an error clip.

    With ``counts``, each forward of ``module`` with grad enabled starts them
    afresh and its backward counts the gradient elements the clip changed (over all the
    output's tensors). Returns the hook handle; ``handle.remove()`` takes the
    clip off again.
    """

    def hook(_module: nn.Module, _inputs, output):
        if counts is not None and torch.is_grad_enabled():  # not a forward without backward (validation)
            counts.start()
        if isinstance(output, Tensor):
            return error_clip(output, clip, counts)
        if isinstance(output, tuple):
            return tuple(error_clip(o, clip, counts) if isinstance(o, Tensor) else o for o in output)
        raise TypeError(f"add_error_clip: unsupported output type {type(output).__name__}")

    return module.register_forward_hook(hook)


class ClipCounts:
    """How many items a clip in backward changed since the forward that last called :meth:`start` (frame
    rows for :func:`recurrent_grad_clip`, gradient elements for :func:`error_clip`), as device tensors: read
    them when logging (``float(counts.fraction_clipped)``), not in backward.

    The counts are two tensors made at the first backward and updated in place after it (zeroed by
    :meth:`start`), so that a CUDA graph of the step, which replays their updates and not this Python, leaves
    its counts where the next reader looks (each graph's own would be stale once another shape's is replayed).
    """

    def __init__(self) -> None:
        self.clipped: Optional[Tensor] = None  # items clipped, float64 (exact counts)
        self.items: Optional[Tensor] = None  # items the clip saw, float64
        self._fresh = True  # start() ran and nothing was added since

    def start(self) -> None:
        """A new forward: the counts of the coming backward start from zero."""
        self._fresh = True

    def add(self, clipped: Tensor, items: int) -> None:
        clipped = clipped.to(torch.float64)
        if self.clipped is None or self.clipped.device != clipped.device:
            self.clipped, self.items = torch.zeros_like(clipped), torch.zeros_like(clipped)
        if self._fresh:  # the first add of a backward: the counts restart (in place, captured with the step)
            self.clipped.zero_()
            self.items.zero_()
            self._fresh = False
        self.clipped.add_(clipped)
        self.items.add_(items)

    @property
    def fraction_clipped(self) -> Optional[Tensor]:
        """None before the first backward, and between a training forward and its backward."""
        return None if self.clipped is None or self._fresh else self.clipped / self.items.clamp(min=1)

    def as_dict(self) -> Dict[str, float]:
        """Plain floats for logging; empty when :attr:`fraction_clipped` is None."""
        fraction = self.fraction_clipped
        return {} if fraction is None else {"fraction_clipped": float(fraction)}


class _RecurrentGradClipFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, threshold: float, stats: Optional[ClipCounts], *states: Tensor):
        ctx.threshold, ctx.stats = threshold, stats
        return tuple(s.view_as(s) for s in states)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        # Kaldi: scale = max(1, |row|^2 / threshold^2) ^ -0.5, i.e. min(1, threshold / |row|); 1 for a zero row.
        sumsq = sum(g.to(torch.promote_types(g.dtype, torch.float32)).square().sum(dim=-1, keepdim=True) for g in grads)
        scale = (sumsq / ctx.threshold**2).clamp(min=1.0).rsqrt()
        if ctx.stats is not None:
            ctx.stats.add((scale < 1.0).sum(), scale.numel())
        return (None, None, *(g * scale.to(g.dtype) for g in grads))


def recurrent_grad_clip(threshold: float, *states: Tensor, stats: Optional[ClipCounts] = None) -> Tuple[Tensor, ...]:
    """The ``states`` unchanged; in backward, each row of their gradients (the last dim; a frame of one
    sequence) scaled so that its L2 norm over all ``states`` together is at most ``threshold``.

    Kaldi nnet3's ``BackpropTruncationComponent`` (``src/nnet3/nnet-general-component.cc``), which its LSTM
    layers (``steps/libs/nnet3/xconfig/lstm.py``) put on the recurrent connections with
    ``clipping-threshold=30``: in the fast-lstm(p) layers of its recipes on the cell and the recurrent
    output (projection) fed to the next frame, taken as one row ``[c_t, r_t]``, so only the derivative that
    comes back from frame t+1 is capped, not the one from the layer's output. The row's factor is
    ``max(1, |row|^2 / threshold^2)^(-1/2)``. Kaldi's component also zeroes, every ``zeroing-interval`` (20)
    frames, the rows whose norm exceeds ``zeroing-threshold`` (15): a conditional truncation of the
    recurrence, not part of this cap.
    """
    if not threshold > 0:
        raise ValueError(f"recurrent_grad_clip needs threshold > 0, got {threshold}")
    if not torch.is_grad_enabled() or not any(s.requires_grad for s in states):
        return states
    return _RecurrentGradClipFunction.apply(float(threshold), stats, *states)
