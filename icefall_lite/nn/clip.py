"""Gradient control: every clipping flavour users know, in one place.

- :func:`clip_grad_norm_`: one global norm over all gradients (PyTorch's
  semantics; the scale can never exceed 1), with non-finite detection that
  names the offending parameters.
- :func:`clip_grad_value_`: element-wise clamp.
- :func:`adaptive_clip_grad_`: unit-wise adaptive gradient clipping (AGC,
  Brock et al. 2021) with the eps floor on the weight norm.
- :class:`ErrorClipByValue`, :func:`error_clip`, :func:`add_error_clip`:
  a clip applied to one tensor's gradient *during* backward, before it flows
  into the ops that produced the tensor (PaddlePaddle's error clip).
- :class:`GradientFilter`: icefall's soft per-sequence gradient filter, and
  its hard-mask variant (sequences above the cutoff dropped, the others untouched).
- :func:`recurrent_grad_clip`: Kaldi nnet3's per-frame cap on the derivative
  that flows back along a recurrent connection (BackpropTruncationComponent).
- Thresholds that follow the history of the global norm, each with a
  ``state_dict`` so that a resumed run clips as the uninterrupted one:
  :class:`RunningMedianThreshold` (a multiple of the running median of the raw
  norm), :class:`ZClipThreshold` (ZClip's z-score rule),
  :class:`AutoClipThreshold` (AutoClip's percentile of every past norm) and
  :class:`ScaledAdamClipping` (icefall ScaledAdam's rule, exactly).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

Tensor = torch.Tensor
# A parameter source: one tensor, tensors, or (name, tensor) pairs such as
# ``model.named_parameters()``. Names are used in error messages.
ParamsLike = Union[Tensor, Iterable[Tensor], Iterable[Tuple[str, Tensor]]]


class NonFiniteGradientError(RuntimeError):
    """Raised by :func:`clip_grad_norm_` when the total gradient norm is NaN/inf."""


def _named_with_grad(parameters: ParamsLike) -> List[Tuple[str, Tensor]]:
    """Normalise a parameter source to ``[(name, param)]`` for params with a grad."""
    if isinstance(parameters, Tensor):
        items: List = [parameters]
    else:
        items = list(parameters)
    named: List[Tuple[str, Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            name, param = item
        else:
            name, param = f"parameter[{i}] shape={tuple(item.shape)}", item
        if param.grad is not None:
            named.append((name, param))
    return named


def _group_by_device_and_dtype(
    grads: Sequence[Tensor],
) -> Dict[Tuple[torch.device, torch.dtype], List[Tensor]]:
    groups: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    return groups


def _use_foreach(device: torch.device, foreach: Optional[bool]) -> bool:
    supported = device.type in ("cpu", "cuda") and not torch.jit.is_scripting()
    if foreach and not supported:
        raise RuntimeError(f"foreach=True is not supported for tensors on {device.type}")
    return supported if foreach is None else foreach


def get_total_norm(grads: Sequence[Tensor], norm_type: float = 2.0, foreach: Optional[bool] = None) -> Tensor:
    """The ``norm_type``-norm of all ``grads`` taken together, as a 0-dim tensor.

    Per-tensor norms are computed per (device, dtype) group (with foreach
    kernels where available), accumulated in at least float32, then combined.
    An empty list gives ``tensor(0.)``.
    """
    norm_type = float(norm_type)
    if len(grads) == 0:
        return torch.tensor(0.0)
    first_device = grads[0].device
    per_tensor: List[Tensor] = []
    for (device, dtype), group in _group_by_device_and_dtype(grads).items():
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if _use_foreach(device, foreach):
            per_tensor.extend(torch._foreach_norm(group, norm_type, dtype=acc_dtype))
        else:
            per_tensor.extend(torch.linalg.vector_norm(g, norm_type, dtype=acc_dtype) for g in group)
    acc_dtype = torch.float64 if any(n.dtype == torch.float64 for n in per_tensor) else torch.float32
    stacked = torch.stack([n.to(device=first_device, dtype=acc_dtype) for n in per_tensor])
    return torch.linalg.vector_norm(stacked, norm_type)


def clip_grad_norm_(
    parameters: ParamsLike,
    max_norm: float,
    norm_type: float = 2.0,
    eps: float = 1e-6,
    error_if_nonfinite: bool = True,
    foreach: Optional[bool] = None,
) -> Tensor:
    """Scale all gradients together so that their global norm is at most ``max_norm``.

    The scale ``min(1, max_norm / (total_norm + eps))`` is computed on the
    device and always multiplied in, so gradients whose global norm is below
    ``max_norm`` are multiplied by exactly 1.0 (bit-identical). It can never
    exceed 1.

    Args:
      parameters: a tensor, tensors, or ``(name, tensor)`` pairs (e.g.
        ``model.named_parameters()``; names appear in error messages).
        Parameters without ``.grad`` are ignored.
      max_norm: the largest allowed global norm (> 0).
      norm_type: p of the p-norm: 1, 2, ``math.inf`` or any positive float.
      eps: added to the norm in the denominator of the scale.
      error_if_nonfinite: when the total norm is NaN or inf, raise
        :class:`NonFiniteGradientError` naming the parameters whose gradients
        are non-finite (default). When False, leave every gradient untouched
        and return the non-finite norm so the caller can skip the step.
      foreach: use foreach kernels (None = where the device supports them).

    Returns:
      The total norm of the gradients *before* clipping (0-dim tensor).
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}")
    named = _named_with_grad(parameters)
    grads = [p.grad for _, p in named]
    total_norm = get_total_norm(grads, norm_type, foreach)
    if len(grads) == 0:
        return total_norm
    if not torch.isfinite(total_norm):
        if error_if_nonfinite:
            bad = [name for name, p in named if not torch.isfinite(p.grad).all()]
            raise NonFiniteGradientError(
                f"The total norm of order {norm_type} of the gradients is "
                f"{total_norm.item()}; non-finite gradients in: {', '.join(bad)}. "
                "Pass error_if_nonfinite=False to skip such steps instead."
            )
        return total_norm
    scale_grads_(grads, norm_clip_scale(total_norm, max_norm, eps), foreach)
    return total_norm


def norm_clip_scale(total_norm: Tensor, max_norm: float, eps: float = 1e-6) -> Tensor:
    """The factor clipping by global norm multiplies every gradient by: ``min(1, max_norm / (total_norm + eps))``.

    A 0-dim tensor on ``total_norm``'s device; never above 1.
    """
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def scale_grads_(grads: Sequence[Tensor], scale: Tensor, foreach: Optional[bool] = None) -> None:
    """Multiply every tensor of ``grads`` in place by the 0-dim ``scale`` (foreach kernels where supported)."""
    for (device, dtype), group in _group_by_device_and_dtype(grads).items():
        scale_here = scale.to(device=device, dtype=dtype)
        if _use_foreach(device, foreach):
            torch._foreach_mul_(group, scale_here)
        else:
            for g in group:
                g.mul_(scale_here)


class RunningMedianThreshold:
    """A clipping threshold relative to the recent gradient norms: ``scale`` times their median.

    Modelled on icefall ScaledAdam's ``clipping_scale`` rule, on the norm it is
    given (``--clip-grad-norm-relative`` gives the raw global norm): every
    step's norm is recorded (the last ``update_period`` kept); the threshold
    is re-estimated at steps 10, 20 and 40 and then every ``update_period``
    steps from the norms recorded so far; before step 10 there is none. It
    carries its own ``state_dict`` so that a resumed run clips as the
    uninterrupted one.

    It is an approximation, kept as it is because the ablation's committed
    runs (and this project's ``ScaledAdam``) use it. icefall's own rule,
    exactly, is :class:`ScaledAdamClipping`; this one differs in that it
    takes any norm (icefall's weights each gradient by its parameter's RMS),
    records step 0 (icefall neither records nor clips it), takes the upper
    median ``sorted[n // 2]`` (icefall ``sorted[(n // 4) * 2]``: not the same
    for 10 norms) and does not double the threshold at steps 10, 20 and 40
    (icefall does, "as norm may be changing rapidly").
    """

    def __init__(self, scale: float, update_period: int) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if update_period < 1:
            raise ValueError(f"update_period must be >= 1, got {update_period}")
        self.scale = scale
        self.update_period = update_period
        self.norms: List[float] = []
        self.threshold: Optional[float] = None
        self.steps = 0

    def update(self, norm: float) -> Optional[float]:
        """Record this step's ``norm``; the threshold for this step (None: no clipping yet)."""
        self.norms = (self.norms + [norm])[-self.update_period :]
        step = self.steps
        if step in (10, 20, 40) or (step > 0 and step % self.update_period == 0):
            recent = sorted(self.norms[-step:])
            self.threshold = self.scale * recent[len(recent) // 2]
        self.steps += 1
        return self.threshold

    def state_dict(self) -> Dict[str, Any]:
        return {"norms": list(self.norms), "threshold": self.threshold, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.norms = list(state["norms"])
        self.threshold = state["threshold"]
        self.steps = int(state["steps"])


class ZClipThreshold:
    """ZClip (Kumar et al. 2025, arXiv 2504.02507): clip the global norm when its z-score is an outlier.

    The authors' rule as their ``zclip`` package (``ZClip.step``, version
    1.0.0) computes it in its default variant, ``mode="zscore"`` with
    ``clip_option="adaptive_scaling"`` (``clip_factor=1``,
    ``skip_update_on_spike=False``); their optional hard cap
    ``max_grad_norm`` is not part of it (``--clip-grad-norm`` combines with
    it, the smaller maximum winning, as in ZClip). For each norm ``g``:

    - warm-up: the first ``warmup_steps`` (25) norms are collected and not
      clipped; after the last of them the mean ``mu`` is their mean and the
      variance ``var`` their population variance (divided by n);
    - then ``z = (g - mu) / (sqrt(var) + eps)``; when ``z > z_threshold``
      (2.5) the norm is clipped to ``mu + z_threshold * sqrt(var) / (z /
      z_threshold)``, i.e. ``mu + z_threshold^2 sigma / z``: the further out,
      the lower the target (never above ``mu + z_threshold sigma``);
    - the moving averages are updated with the clipped target when it clipped,
      else with ``g``, mean first and the variance with the new mean:
      ``mu <- alpha mu + (1 - alpha) x``,
      ``var <- alpha var + (1 - alpha) (x - mu)^2`` (``alpha`` 0.97).

    :meth:`update` returns the step's maximum norm (None: no clipping); the
    gradients are scaled by ``max / (g + 1e-6)``, as ZClip's.
    """

    def __init__(self, z_threshold: float = 2.5, alpha: float = 0.97, warmup_steps: int = 25, eps: float = 1e-6):
        if not z_threshold > 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.z_threshold = float(z_threshold)
        self.alpha = float(alpha)
        self.warmup_steps = int(warmup_steps)
        self.eps = float(eps)
        self.buffer: List[float] = []
        self.mean: Optional[float] = None
        self.var: Optional[float] = None

    def update(self, norm: float) -> Optional[float]:
        """Record this step's global ``norm``; the maximum norm of this step (None: no clipping)."""
        if self.mean is None:
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.buffer = []
            return None
        std = self.var**0.5
        z = (norm - self.mean) / (std + self.eps)
        target = None
        if z > self.z_threshold:
            target = self.mean + (self.z_threshold * std) / (z / self.z_threshold)
        x = norm if target is None else target
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return target

    def state_dict(self) -> Dict[str, Any]:
        return {"buffer": list(self.buffer), "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.buffer = list(state["buffer"])
        self.mean = state["mean"]
        self.var = state["var"]


class AutoClipThreshold:
    """AutoClip (Seetharaman, Wichern, Pardo, Le Roux, MLSP 2020, arXiv 2007.14469): clip the global norm
    at the ``percentile``-th percentile of every norm seen so far, this step's included.

    As the authors' reference code (``pseeth/autoclip``'s ``autoclip.py``):
    the step's norm is appended to the history, the threshold is
    ``numpy.percentile(history, p)`` (linear interpolation between the
    closest ranks) and the gradients are clipped to it by global norm. The
    history is never truncated. A norm at or below its threshold is left
    exactly as it is (the paper's factor ``min(threshold / norm, 1)``; the
    reference code's ``clip_grad_norm_`` would multiply it by ``norm / (norm
    + 1e-6)``). The paper tried p = 0 (the minimum so far),
    1, 10, 25, 50, 90 and 100 (never clips) and recommends p = 10 as
    "set-and-forget". Not the PyPI ``autoclip`` package's ``QuantileClip``,
    which leaves the step's own norm out of its history (so it clips its
    first step at infinity), keeps only the last 1000 norms and by default
    clips each parameter by its own history.
    """

    def __init__(self, percentile: float) -> None:
        if not 0.0 <= percentile <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {percentile}")
        self.percentile = float(percentile)
        self.history: List[float] = []  # sorted

    def update(self, norm: float) -> float:
        """Record this step's ``norm``; this step's maximum norm (the percentile of the history)."""
        bisect.insort(self.history, norm)
        return percentile_linear(self.history, self.percentile)

    def state_dict(self) -> Dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history = sorted(state["history"])


def percentile_linear(ascending: Sequence[float], percentile: float) -> float:
    """The ``percentile``-th percentile of the ascending values, as ``numpy.percentile``'s default ("linear",
    type 7 of Hyndman and Fan): the point at rank ``p / 100 * (n - 1)`` between the two closest values."""
    if not ascending:
        raise ValueError("percentile of no values")
    rank = (len(ascending) - 1) * (percentile / 100.0)
    below = math.floor(rank)
    above = min(below + 1, len(ascending) - 1)
    frac = rank - below
    low, high = ascending[below], ascending[above]
    # numpy's lerp: from the nearer end, so that frac 1 gives the upper value exactly.
    return low + (high - low) * frac if frac < 0.5 else high - (high - low) * (1 - frac)


class ScaledAdamClipping:
    """icefall ScaledAdam's gradient clipping (``clipping_scale``), exactly as its ``_get_clipping_scale``
    computes it (``k2-fsa/icefall``, ``egs/librispeech/ASR/zipformer/optim.py``), outside the optimizer.

    Per step s (counted as the optimizer's steps, from 0):

    - the norm is that of the gradients each multiplied by its parameter's
      RMS ``sqrt(mean(p^2))`` (per tensor; a one-element parameter's
      gradient by ``scalar_lr_scale``, 0.1, instead):
      ``sqrt(sum_p ||g_p r_p||^2)``. The RMS is the optimizer's own
      ``param_rms`` state: measured at step 0 and re-measured every
      ``size_update_period`` (4) steps, at the steps s with ``s % 4 == 3``
      after clipping (from the weights before that step's update), so a step
      clips with an RMS up to four updates old. No floor: a zero-initialised
      bias counts for nothing until it grows (icefall's ``param_min_rms``
      floor of 1e-5 applies to its update size, not to this norm);
    - step 0 is neither clipped nor recorded (ScaledAdam has no state yet);
    - from step 1 the norm goes into a ring of ``clipping_update_period``
      (100) slots, first all zero, at slot ``s % 100``;
    - the threshold is set at steps 10, 20 and 40 (those below the period),
      from the ``s`` largest slots (the norms so far), and then at every
      step with ``s % 100 == 0``, from all 100 slots: ``clipping_scale`` x
      their "median" ``sorted[(n // 4) * 2]`` (of 10 norms the 5th smallest),
      doubled at steps 10, 20 and 40 ("as norm may be changing rapidly").
      Before step 10 there is none and nothing is clipped; the step's own
      norm is recorded before the threshold is estimated;
    - the factor is ``min(1, threshold / (norm + 1e-20))`` (0 if that is NaN:
      the gradients are zeroed); a NaN median raises.

    icefall clips each parameter group by itself; a model trained with one
    group (the recipes) has one global rule, as here. :meth:`scale` returns the
    factor to multiply every gradient by.
    """

    def __init__(
        self,
        clipping_scale: float = 2.0,
        clipping_update_period: int = 100,
        scalar_lr_scale: float = 0.1,
        size_update_period: int = 4,
    ) -> None:
        if not clipping_scale > 0:
            raise ValueError(f"clipping_scale must be > 0, got {clipping_scale}")
        if clipping_update_period < 1 or size_update_period < 1:
            raise ValueError(f"the update periods must be >= 1, got {clipping_update_period} and {size_update_period}")
        self.clipping_scale = float(clipping_scale)
        self.clipping_update_period = int(clipping_update_period)
        self.scalar_lr_scale = float(scalar_lr_scale)
        self.size_update_period = int(size_update_period)
        self.step = 0
        self.model_norms: Optional[Tensor] = None  # the ring of norms, float32 on the gradients' device
        self.threshold: Optional[float] = None
        self.param_rms: Dict[str, float] = {}  # float32 values, by parameter name
        self.last_norm: Optional[float] = None  # the weighted norm of the last step (for logging)

    def _measure_rms(self, named: Sequence[Tuple[str, Tensor]]) -> None:
        """``param_rms`` of every parameter of more than one element, with one host sync."""
        tensors = [(name, p) for name, p in named if p.numel() > 1]
        if not tensors:
            return
        device = tensors[0][1].device
        rms = [p.detach().square().mean().sqrt().to(device=device, dtype=torch.float32) for _, p in tensors]
        self.param_rms.update(zip([name for name, _ in tensors], torch.stack(rms).tolist()))

    def scale(self, named: Sequence[Tuple[str, Tensor]]) -> float:
        """Record this step; the factor to multiply every gradient by (1: not clipped).

        Args:
          named: every trained parameter as ``(name, parameter)``, the same
            names every step (a parameter without ``.grad`` counts as a zero
            gradient, as in ScaledAdam).
        """
        step = self.step
        if step == 0:
            self._measure_rms(named)
            self.step = 1
            return 1.0
        missing = [(name, p) for name, p in named if p.numel() > 1 and name not in self.param_rms]
        if missing:  # a parameter this rule has not seen yet: measured now
            self._measure_rms(missing)
        with_grad = [(name, p) for name, p in named if p.grad is not None]
        if not with_grad:
            raise ValueError("ScaledAdamClipping.scale: no parameter has a gradient")
        grads = [p.grad for _, p in with_grad]
        device = grads[0].device
        weights = torch.tensor(
            [self.scalar_lr_scale if p.numel() == 1 else self.param_rms[name] for name, p in with_grad],
            dtype=torch.float32,
            device=device,
        )
        norms = torch.stack([n.to(device=device, dtype=torch.float32) for n in _per_tensor_norms(grads)])
        tot_norm = torch.linalg.vector_norm(norms * weights)
        period = self.clipping_update_period
        if self.model_norms is None:
            self.model_norms = torch.zeros(period, dtype=torch.float32, device=device)
        elif self.model_norms.device != device:  # restored from a checkpoint (kept on the CPU)
            self.model_norms = self.model_norms.to(device)
        self.model_norms[step % period] = tot_norm
        irregular = [i for i in (10, 20, 40) if i < period]
        if step % period == 0 or step in irregular:
            sorted_norms = self.model_norms.sort()[0].cpu()
            if step in irregular:
                sorted_norms = sorted_norms[-step:]
            num_norms = sorted_norms.numel()
            median = sorted_norms[min(num_norms - 1, (num_norms // 4) * 2)].item()
            if median - median != 0:
                raise RuntimeError("ScaledAdamClipping: too many gradients were not finite (the median norm is NaN)")
            threshold = self.clipping_scale * median
            if step in irregular:
                threshold = threshold * 2.0
            self.threshold = threshold
        ans = 1.0
        if self.threshold is not None:
            ans = min(1.0, (self.threshold / (tot_norm + 1.0e-20)).item())
            if ans != ans:
                ans = 0.0
        if step % self.size_update_period == self.size_update_period - 1:
            self._measure_rms(named)
        self.last_norm = float(tot_norm)
        self.step = step + 1
        return ans

    def state_dict(self) -> Dict[str, Any]:
        return {
            "step": self.step,
            "model_norms": None if self.model_norms is None else self.model_norms.detach().cpu().clone(),
            "threshold": self.threshold,
            "param_rms": dict(self.param_rms),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        norms = state["model_norms"]
        self.model_norms = None if norms is None else norms.clone()
        self.threshold = state["threshold"]
        self.param_rms = dict(state["param_rms"])


def _per_tensor_norms(grads: Sequence[Tensor]) -> List[Tensor]:
    """The L2 norm of each gradient (foreach kernels per device and dtype where supported), in order."""
    out: List[Optional[Tensor]] = [None] * len(grads)
    index = {id(g): i for i, g in enumerate(grads)}
    for (device, dtype), group in _group_by_device_and_dtype(grads).items():
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if _use_foreach(device, None):
            norms = torch._foreach_norm(group, 2.0, dtype=acc_dtype)
        else:
            norms = [torch.linalg.vector_norm(g, dtype=acc_dtype) for g in group]
        for g, n in zip(group, norms):
            out[index[id(g)]] = n
    return out


def clip_scale_above(norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """The factor of a norm clip that acts only above its maximum: ``max_norm / (norm + eps)`` when
    ``norm > max_norm``, else exactly 1 (ZClip's and AutoClip's papers; torch's ``clip_grad_norm_``
    always multiplies, so a norm equal to its maximum would read as clipped)."""
    return max_norm / (norm + eps) if norm > max_norm else 1.0


def clip_grad_value_(parameters: ParamsLike, max: float, min: Optional[float] = None) -> None:
    """Clamp every gradient element into ``[min, max]`` in place (``min`` defaults to ``-max``)."""
    low = -max if min is None else min
    if not low <= max:
        raise ValueError(f"clip_grad_value_ needs min <= max, got min={low}, max={max}")
    for _, p in _named_with_grad(parameters):
        p.grad.clamp_(min=low, max=max)


def unitwise_norm(x: Tensor) -> Tensor:
    """L2 norm per output unit, broadcastable to ``x``.

    A scalar or vector (bias, gain) is one unit; otherwise dim 0 indexes the
    units: the rows of a linear weight ``(out, in)``, the filters of a conv
    weight ``(out, in, kh, kw)``.
    """
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad_(
    parameters: ParamsLike,
    clipping: float = 0.01,
    eps: float = 1e-3,
    exclude: Iterable[Union[str, Tensor]] = (),
) -> Tensor:
    """Unit-wise adaptive gradient clipping (AGC, arXiv 2102.06171), in place.

    For each unit i: if ``||G_i|| / max(||W_i||, eps) > clipping`` then
    ``G_i <- clipping * max(||W_i||, eps) / ||G_i|| * G_i``.

    Args:
      parameters: tensors or ``(name, tensor)`` pairs.
      clipping: lambda, the largest allowed gradient-to-weight norm ratio.
      eps: floor on the weight norm, so zero-initialised units still learn.
      exclude: parameters (tensors, or names when ``parameters`` is named) left
        unclipped; the paper excludes the final classifier layer.

    Returns:
      The fraction of units that were clipped (0-dim float tensor).
    """
    if clipping <= 0:
        raise ValueError(f"clipping must be > 0, got {clipping}")
    excluded_names = {e for e in exclude if isinstance(e, str)}
    excluded_ids = {id(e) for e in exclude if isinstance(e, Tensor)}
    num_units = 0
    num_clipped: Optional[Tensor] = None
    for name, p in _named_with_grad(parameters):
        if name in excluded_names or id(p) in excluded_ids:
            continue
        weight_norm = unitwise_norm(p.detach()).clamp(min=eps)
        grad_norm = unitwise_norm(p.grad)
        max_norm = clipping * weight_norm
        clip_mask = grad_norm > max_norm
        scale = torch.where(clip_mask, max_norm / grad_norm.clamp(min=1e-6), torch.ones_like(grad_norm))
        p.grad.mul_(scale.to(p.grad.dtype))
        num_units += clip_mask.numel()
        clipped_here = clip_mask.sum().float()
        num_clipped = clipped_here if num_clipped is None else num_clipped + clipped_here.to(num_clipped.device)
    if num_clipped is None:
        return torch.tensor(0.0)
    return num_clipped / num_units


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


class _GradientFilterFunction(torch.autograd.Function):
    """Identity forward; icefall's soft per-element gradient filter in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, batch_dim: int, threshold: float, stats: "GradientFilterStats", *params: Tensor):
        ctx.batch_dim = batch_dim
        ctx.threshold = threshold
        ctx.stats = stats
        return (x.view_as(x),) + tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, x_grad: Tensor, *param_grads: Tensor):
        eps = 1e-20
        batch_dim = ctx.batch_dim % x_grad.ndim
        norm_dims = [d for d in range(x_grad.ndim) if d != batch_dim]
        # n_b: RMS of the gradient of batch element b, shape broadcastable to x.
        norm = (
            x_grad.to(torch.promote_types(x_grad.dtype, torch.float32))
            .square()
            .mean(dim=norm_dims, keepdim=True)
            .sqrt()
        )
        median_norm = norm.median()
        if math.isinf(ctx.threshold):
            # Observing only: the statistics, and the gradients untouched.
            ctx.stats.update(norm, median_norm, torch.full_like(median_norm, math.inf), torch.ones_like(median_norm))
            return (x_grad, None, None, None) + param_grads
        cutoff = median_norm * ctx.threshold
        inv_mask = (cutoff + norm) / (cutoff + eps)  # (c + n_b) / c
        # Degenerate case (icefall would scale by 1e20 here): when the median
        # gradient is exactly zero (e.g. x needs no grad), filter nothing.
        inv_mask = torch.where(cutoff > 0, inv_mask, torch.ones_like(inv_mask))
        x_grad = x_grad * (1.0 / (inv_mask + eps)).to(x_grad.dtype)
        param_scale = 1.0 / (inv_mask.mean() + eps)  # = 1 / (1 + mean(n) / c)
        new_param_grads = tuple(g * param_scale.to(g.dtype) for g in param_grads)
        ctx.stats.update(norm, median_norm, cutoff, param_scale)
        return (x_grad, None, None, None) + new_param_grads


class _HardMaskFunction(torch.autograd.Function):
    """``fn(*inputs)`` in forward; in backward the batch elements whose gradient at ``inputs[0]`` is above the
    cutoff are dropped from every input's gradient (see :meth:`GradientFilter.around`)."""

    @staticmethod
    def forward(ctx, fn, batch_dim: int, threshold: float, stats: "GradientFilterStats", *inputs: Tensor):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            outputs = tuple(fn(*leaves))
        ctx.leaves, ctx.outputs = leaves, outputs
        ctx.batch_dim, ctx.threshold, ctx.stats = batch_dim, threshold, stats
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
            norm_dims = [d for d in range(x_grad.ndim) if d != batch_dim]
            norm = x_grad.to(torch.promote_types(x_grad.dtype, torch.float32)).square().mean(dim=norm_dims).sqrt()
            median_norm = norm.median()
            cutoff = median_norm * ctx.threshold
            ctx.stats.update(norm, median_norm, cutoff, torch.ones_like(median_norm))
            drop = (norm > cutoff) & (cutoff > 0)
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
        return (None, None, None, None, *out)


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
        self.num_backward = 0

    def update(self, norm: Tensor, median_norm: Tensor, cutoff: Tensor, param_scale: Tensor) -> None:
        self.median_norm = median_norm.detach()
        self.max_over_median = (norm.max() / median_norm.clamp(min=1e-20)).detach()
        self.fraction_filtered = ((norm > cutoff) & (cutoff > 0)).float().mean().detach()
        self.param_scale = param_scale.detach()
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


class ClipCounts:
    """How many items a clip in backward changed since the forward that last called :meth:`start` (frame
    rows for :func:`recurrent_grad_clip`, gradient elements for :func:`error_clip`), as device tensors: read
    them when logging (``float(counts.fraction_clipped)``), not in backward."""

    def __init__(self) -> None:
        self.items = 0
        self.clipped: Optional[Tensor] = None

    def start(self) -> None:
        """A new forward: the counts of the coming backward start from zero."""
        self.items = 0
        self.clipped = None

    def add(self, clipped: Tensor, items: int) -> None:
        self.clipped = clipped if self.clipped is None else self.clipped + clipped
        self.items += items

    @property
    def fraction_clipped(self) -> Optional[Tensor]:
        return None if self.clipped is None else self.clipped.float() / max(self.items, 1)

    def as_dict(self) -> Dict[str, float]:
        """Plain floats for logging; empty before the first backward."""
        return {} if self.clipped is None else {"fraction_clipped": float(self.fraction_clipped)}


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


GRAD_FILTER_MODES = ("soft", "hard-mask")


class GradientFilter(nn.Module):
    """icefall's GradientFilter: identity forward, soft per-element filter in backward; or its hard-mask variant.

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

    ``threshold = inf`` observes only: the statistics are recorded and every
    gradient passes unchanged (the ablation's arms without the filter use it
    to see where per-sequence outliers arise). It is not meant to be
    constructed with ``threshold <= 0``: the owner does not insert a filter at
    all then (see :class:`icefall_lite.nn.scaling.ScaledLSTM`).
    Statistics of the last backward are in :attr:`stats` (``param_scale`` is
    1 in hard-mask mode).
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

    def forward(self, x: Tensor, *params: Tensor) -> Tuple[Tensor, ...]:
        """The soft filter: ``(x, *params)``, unchanged in forward."""
        if self.mode != "soft":
            raise RuntimeError("a hard-mask GradientFilter wraps the computation it filters: call around(fn, x, ...)")
        if not self._active():
            return (x,) + tuple(params)
        return _GradientFilterFunction.apply(x, self.batch_dim, self.threshold, self.stats, *params)

    def around(self, fn: Callable[..., Sequence[Tensor]], x: Tensor, *others: Tensor) -> Tuple[Tensor, ...]:
        """The hard-mask filter: ``tuple(fn(x, *others))``, whose backward drops the batch elements whose
        gradient at ``x`` is above the cutoff.

        ``fn`` must treat the batch elements independently, and every output
        must have the batch at ``batch_dim``.
        """
        if self.mode != "hard-mask":
            raise RuntimeError("around() is the hard-mask filter's; a soft GradientFilter is called on (x, *params)")
        if not self._active():
            return tuple(fn(x, *others))
        return _HardMaskFunction.apply(fn, self.batch_dim, self.threshold, self.stats, x, *others)

    def extra_repr(self) -> str:
        mode = "" if self.mode == "soft" else f", mode={self.mode}"
        return f"batch_dim={self.batch_dim}, threshold={self.threshold}{mode}"


def check_grad_filter_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`GRAD_FILTER_MODES`, else a ValueError naming the flag."""
    if mode not in GRAD_FILTER_MODES:
        raise ValueError(f"--grad-filter-mode must be one of {', '.join(GRAD_FILTER_MODES)}, got {mode!r}")
    return mode
