"""icefall's GradientFilter, in backward: each sequence's gradient against the batch's median, in one of
:data:`GRAD_FILTER_MODES` (soft, hard-mask, uniform)."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

Tensor = torch.Tensor


def _row_norms(x_grad: Tensor, batch_dim: int, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Each batch element's gradient RMS, their median, and which elements are real.

    Args:
      x_grad: the gradient, batch at ``batch_dim`` (e.g. (T, N, C), ``batch_dim=1``).
      mask: None (every position counts, as icefall) or broadcastable to ``x_grad`` with size N at
        ``batch_dim`` (e.g. (T, N, 1)): 1 where a position counts. The RMS is over the counted positions, and
        an element with none (a dummy row) is left out of the median.
    Returns:
      ``norm`` (keepdim: broadcastable to ``x_grad``; 0 for a dummy row), the (lower) median of the real
      elements' norms, and the real elements as a bool tensor of ``norm``'s shape (None without a mask).
    """
    batch_dim = batch_dim % x_grad.ndim
    norm_dims = [d for d in range(x_grad.ndim) if d != batch_dim]
    squares = x_grad.to(torch.promote_types(x_grad.dtype, torch.float32)).square()
    if mask is None:
        norm = squares.mean(dim=norm_dims, keepdim=True).sqrt()
        return norm, norm.median(), None
    mask = mask.to(squares.dtype)
    count = mask.expand_as(squares).sum(dim=norm_dims, keepdim=True)
    norm = ((squares * mask).sum(dim=norm_dims, keepdim=True) / count.clamp(min=1.0)).sqrt()
    real = count > 0
    # torch.median's lower median over the real elements alone, without reading their number on the host:
    # the dummy rows sort last (inf), the median is element (n - 1) // 2 of the sorted norms.
    ordered = torch.where(real, norm, torch.full_like(norm, math.inf)).flatten().sort().values
    middle = ((real.sum() - 1) // 2).clamp(min=0).view(1)
    return norm, ordered.gather(0, middle).squeeze(0), real


def _mean_over_rows(values: Tensor, real: Optional[Tensor]) -> Tensor:
    """The mean of per-element ``values`` over the real elements (:func:`_row_norms`; all when None)."""
    if real is None:
        return values.mean()
    real = real.to(values.dtype)
    return (values * real).sum() / real.sum().clamp(min=1.0)


class _GradientFilterFunction(torch.autograd.Function):
    """Identity forward; icefall's soft per-element gradient filter in backward."""

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        batch_dim: int,
        threshold: float,
        stats: "GradientFilterStats",
        mask: Optional[Tensor],
        *params: Tensor,
    ):
        ctx.batch_dim = batch_dim
        ctx.threshold = threshold
        ctx.stats = stats
        ctx.mask = mask
        return (x.view_as(x),) + tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, x_grad: Tensor, *param_grads: Tensor):
        eps = 1e-20
        # n_b: RMS of the gradient of batch element b, shape broadcastable to x.
        norm, median_norm, real = _row_norms(x_grad, ctx.batch_dim, ctx.mask)
        if math.isinf(ctx.threshold):
            # Observing only: the statistics, and the gradients untouched.
            infinite = torch.full_like(median_norm, math.inf)
            ctx.stats.update(norm, median_norm, infinite, torch.ones_like(median_norm), real)
            return (x_grad, None, None, None, None) + param_grads
        cutoff = median_norm * ctx.threshold
        inv_mask = (cutoff + norm) / (cutoff + eps)  # (c + n_b) / c
        # Degenerate case (icefall would scale by 1e20 here): when the median
        # gradient is exactly zero (e.g. x needs no grad), filter nothing.
        inv_mask = torch.where(cutoff > 0, inv_mask, torch.ones_like(inv_mask))
        x_grad = x_grad * (1.0 / (inv_mask + eps)).to(x_grad.dtype)
        param_scale = 1.0 / (_mean_over_rows(inv_mask, real) + eps)  # = 1 / (1 + mean(n) / c)
        new_param_grads = tuple(g * param_scale.to(g.dtype) for g in param_grads)
        ctx.stats.update(norm, median_norm, cutoff, param_scale, real)
        return (x_grad, None, None, None, None) + new_param_grads


class _UniformFilterFunction(_GradientFilterFunction):
    """Identity forward (the soft filter's); in backward every sequence's gradient scaled by the mean of the
    soft filter's factors (see :class:`GradientFilter`, ``mode="uniform"``)."""

    @staticmethod
    def backward(ctx, x_grad: Tensor, *param_grads: Tensor):
        norm, median, real = _row_norms(x_grad, ctx.batch_dim, ctx.mask)
        cutoff = median * ctx.threshold
        if float(cutoff) > 0:  # one host sync per backward
            factors = cutoff / (cutoff + norm)  # the soft filter's per-sequence factors
            mean_factor = _mean_over_rows(factors, real)
            param_scale = 1.0 / (1.0 + _mean_over_rows(norm, real) / cutoff)
        else:  # as the soft filter: a zero median gradient filters nothing
            mean_factor = param_scale = torch.ones_like(median)
        ctx.stats.update(norm, median, cutoff, param_scale, real)
        scaled = tuple(g * param_scale.to(g.dtype) for g in param_grads)
        return (x_grad * mean_factor.to(x_grad.dtype), None, None, None, None) + scaled


class _HardMaskFunction(torch.autograd.Function):
    """``fn(*inputs)`` in forward; in backward the batch elements whose gradient at ``inputs[0]`` is above the
    cutoff are dropped from every input's gradient (see :meth:`GradientFilter.around`)."""

    @staticmethod
    def forward(
        ctx, fn, batch_dim: int, threshold: float, stats: "GradientFilterStats", mask: Optional[Tensor], *inputs: Tensor
    ):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            outputs = tuple(fn(*leaves))
        ctx.leaves, ctx.outputs = leaves, outputs
        ctx.batch_dim, ctx.threshold, ctx.stats, ctx.mask = batch_dim, threshold, stats, mask
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *output_grads: Tensor):
        leaves, outputs = ctx.leaves, ctx.outputs
        del ctx.leaves, ctx.outputs  # the inner graph goes with the last backward through it
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        used = [(o, g) for o, g in zip(outputs, output_grads) if g is not None and o.requires_grad]

        def backward_through(grads_out: List[Tensor], retain: bool) -> Tuple[Optional[Tensor], ...]:
            return torch.autograd.grad(
                [o for o, _ in used], [leaves[i] for i in wanted], grads_out, retain_graph=retain, allow_unused=True
            )

        grads = backward_through([g for _, g in used], retain=True)
        x_grad = grads[0] if wanted and wanted[0] == 0 else None
        if x_grad is not None:
            batch_dim = ctx.batch_dim % x_grad.ndim
            norm, median_norm, real = _row_norms(x_grad, batch_dim, ctx.mask)
            norm, real = norm.flatten(), None if real is None else real.flatten()
            cutoff = median_norm * ctx.threshold
            ctx.stats.update(norm, median_norm, cutoff, torch.ones_like(median_norm), real)
            drop = (norm > cutoff) & (cutoff > 0)  # never a dummy row: its norm is 0
            if not math.isinf(ctx.threshold) and bool(drop.any()):  # one host sync per backward
                keep = (~drop).to(x_grad.dtype)
                masked = []
                for o, g in used:
                    shape = [1] * o.ndim
                    shape[batch_dim] = o.shape[batch_dim]
                    masked.append(g * keep.to(g.dtype).view(shape))
                grads = backward_through(masked, retain=False)
        out: List[Optional[Tensor]] = [None] * len(leaves)
        for i, g in zip(wanted, grads):
            out[i] = g
        return (None, None, None, None, None, *out)


class GradientFilterStats:
    """Statistics of a :class:`GradientFilter`'s last backward, as detached tensors.

    Reading them (``float(stats.fraction_filtered)``) is left to the trainer, so
    backward never forces a device sync.
    """

    def __init__(self) -> None:
        self.median_norm: Optional[Tensor] = None
        self.max_over_median: Optional[Tensor] = None
        self.fraction_filtered: Optional[Tensor] = None
        self.param_scale: Optional[Tensor] = None
        # Each batch element's gradient RMS over the batch median, shape (N,) (train.py --log-sequence-gradients).
        self.ratio: Optional[Tensor] = None
        self.num_backward = 0

    def update(
        self, norm: Tensor, median_norm: Tensor, cutoff: Tensor, param_scale: Tensor, real: Optional[Tensor]
    ) -> None:
        """``norm`` and ``real`` (the real elements, None = all) as :func:`_row_norms` gives them.

        The four scalars are tensors made at the first backward and copied into after it, so that a CUDA
        graph of the step, which replays the copies and not this Python, leaves them where the next reader
        looks (each graph's own would be stale once another shape's is replayed). ``ratio`` (one value per
        row) is made anew: its length is the batch's."""
        self.ratio = (norm.flatten() / median_norm.clamp(min=1e-20)).detach()
        values = {
            "median_norm": median_norm,
            "max_over_median": norm.max() / median_norm.clamp(min=1e-20),
            "fraction_filtered": _mean_over_rows(((norm > cutoff) & (cutoff > 0)).float(), real),
            "param_scale": param_scale,
        }
        for name, value in values.items():
            kept = getattr(self, name)
            value = value.detach()
            if kept is None or kept.dtype != value.dtype or kept.device != value.device:
                setattr(self, name, value.clone())
            else:
                kept.copy_(value)
        self.num_backward += 1

    def as_dict(self) -> Dict[str, float]:
        """Plain floats for logging; empty before the first backward."""
        if self.num_backward == 0:
            return {}
        return {
            "median_norm": float(self.median_norm),
            "max_over_median": float(self.max_over_median),
            "fraction_filtered": float(self.fraction_filtered),
            "param_scale": float(self.param_scale),
        }


GRAD_FILTER_MODES = ("soft", "hard-mask", "uniform")


class GradientFilter(nn.Module):
    """icefall's GradientFilter: identity forward, soft per-element filter in backward; or its hard-mask or
    uniform variant.

    ``mode="soft"`` (icefall's): forward returns ``(x, *params)`` unchanged.
    In backward, with ``x`` of shape ``(T, N, C)`` and ``batch_dim=1``:

    - ``n_b = sqrt(mean_{t,c} g[t,b,c]^2)`` for each batch element b;
    - ``c = threshold * median_b(n_b)``;
    - ``g_b <- g_b * c / (c + n_b)`` (an element far above the cutoff is
      capped near norm c; one at the median is scaled by about
      ``threshold / (threshold + 1)``);
    - every parameter gradient ``<- grad / (1 + mean_b(n_b) / c)``.

    ``mode="hard-mask"``: the batch elements with ``n_b > c`` are dropped
    from the gradient of the computation the filter wraps (:meth:`around`:
    in ScaledLSTM, the LSTM kernel): their rows of the input gradient are
    zero and the parameters' gradients are those of the other elements alone
    (the backward is run again with their output gradients zeroed, which is
    exact because the elements of a batch do not interact in an LSTM); every
    other gradient is exactly as without a filter (no soft scaling). So the
    two modes tell the filter's masking from its soft scaling. The second
    backward runs only when some element is dropped, and deciding it reads
    one value from the device per backward.

    ``mode="uniform"``: the soft filter's factors ``c / (c + n_b)`` are
    computed and their mean applied to every batch element alike (the
    parameter gradients as in soft mode): the same shrinking step by step,
    no per-sequence capping; it tells what the filter does beyond a
    transient cut of the step size. Reads one value from the device per
    backward.

    ``threshold = inf`` observes only: the statistics are recorded and every
    gradient passes unchanged (the ablation's arms without the filter use it
    to see where per-sequence outliers arise). It is not meant to be
    constructed with ``threshold <= 0``: the owner does not insert a filter at
    all then (see :class:`icefall_lite.nn.scaling.ScaledLSTM`).
    ``mask`` (every mode; optional, broadcastable to ``x``, e.g. (T, N, 1)) names the positions the
    statistics count: each element's RMS is over its counted positions, and the median, the mean of the
    factors and ``fraction_filtered`` are over the elements with any (a padded batch's dummy rows have none),
    so padding a batch to a static shape changes nothing here (the encoder gives it:
    :func:`icefall_lite.nn.encoder.extent_mask`). Without it every position counts, as in icefall.

    Statistics of the last backward are in :attr:`stats` (``param_scale`` is
    1 in hard-mask mode; ``fraction_filtered`` in uniform mode counts the
    elements above the cutoff, which it does not cap).
    """

    def __init__(self, batch_dim: int, threshold: float, mode: str = "soft") -> None:
        super().__init__()
        if not threshold > 0:
            raise ValueError(f"GradientFilter needs threshold > 0, got {threshold}; use no filter instead")
        self.batch_dim = batch_dim
        self.threshold = float(threshold)
        self.mode = check_grad_filter_mode(mode)
        self.stats = GradientFilterStats()

    @staticmethod
    def _active() -> bool:
        return not (torch.jit.is_scripting() or torch.jit.is_tracing() or not torch.is_grad_enabled())

    def forward(self, x: Tensor, *params: Tensor, mask: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
        """The soft or uniform filter: ``(x, *params)``, unchanged in forward; ``mask``: see the class."""
        if self.mode == "hard-mask":
            raise RuntimeError("a hard-mask GradientFilter wraps the computation it filters: call around(fn, x, ...)")
        if not self._active():
            return (x,) + tuple(params)
        # Observing (threshold inf) is the same in every mode: the soft filter's statistics, no change.
        uniform = self.mode == "uniform" and math.isfinite(self.threshold)
        function = _UniformFilterFunction if uniform else _GradientFilterFunction
        return function.apply(x, self.batch_dim, self.threshold, self.stats, mask, *params)

    def around(
        self, fn: Callable[..., Sequence[Tensor]], x: Tensor, *others: Tensor, mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, ...]:
        """The hard-mask filter: ``tuple(fn(x, *others))``, whose backward drops the batch elements whose
        gradient at ``x`` is above the cutoff.

        ``fn`` must treat the batch elements independently, and every output
        must have the batch at ``batch_dim``.
        """
        if self.mode != "hard-mask":
            raise RuntimeError(
                f"around() is the hard-mask filter's; a {self.mode} GradientFilter is called on (x, *params)"
            )
        if not self._active():
            return tuple(fn(x, *others))
        return _HardMaskFunction.apply(fn, self.batch_dim, self.threshold, self.stats, mask, x, *others)

    def extra_repr(self) -> str:
        mode = "" if self.mode == "soft" else f", mode={self.mode}"
        return f"batch_dim={self.batch_dim}, threshold={self.threshold}{mode}"


def check_grad_filter_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`GRAD_FILTER_MODES`, else a ValueError naming the flag."""
    if mode not in GRAD_FILTER_MODES:
        raise ValueError(f"--grad-filter-mode must be one of {', '.join(GRAD_FILTER_MODES)}, got {mode!r}")
    return mode
