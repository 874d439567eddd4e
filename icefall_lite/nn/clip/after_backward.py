"""The rules that act on the parameters' gradients after backward, from this step's gradients alone.

- :func:`clip_grad_norm_`: one global norm over all gradients (PyTorch's
  semantics; the scale can never exceed 1), with non-finite detection that
  names the offending parameters; :func:`get_total_norm`,
  :func:`norm_clip_scale` and :func:`scale_grads_` are its steps, which the
  rules that follow the norm's history share.
- :func:`clip_grad_value_`: element-wise clamp.
- :func:`adaptive_clip_grad_`: unit-wise adaptive gradient clipping (AGC,
  Brock et al. 2021) with the eps floor on the weight norm.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

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


def norm_clip_scale(total_norm: Tensor, max_norm: Union[float, Tensor], eps: float = 1e-6) -> Tensor:
    """The factor clipping by global norm multiplies every gradient by: ``min(1, max_norm / (total_norm + eps))``.

    A 0-dim tensor on ``total_norm``'s device, in its dtype; never above 1. ``max_norm`` a Python float or
    a 0-dim tensor (moved to ``total_norm``'s device and dtype): either gives the same bits, as the division
    is written the way torch divides a Python number by a tensor (a reciprocal times the number).
    """
    if isinstance(max_norm, Tensor):
        max_norm = max_norm.to(total_norm)
    return torch.clamp((total_norm + eps).reciprocal() * max_norm, max=1.0)


def scale_grads_(grads: Sequence[Tensor], scale: Tensor, foreach: Optional[bool] = None) -> None:
    """Multiply every tensor of ``grads`` in place by the 0-dim ``scale`` (foreach kernels where supported)."""
    for (device, dtype), group in _group_by_device_and_dtype(grads).items():
        scale_here = scale.to(device=device, dtype=dtype)
        if _use_foreach(device, foreach):
            torch._foreach_mul_(group, scale_here)
        else:
            for g in group:
                g.mul_(scale_here)


def per_tensor_norms(grads: Sequence[Tensor]) -> List[Tensor]:
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


def clip_scale_above(norm: Tensor, max_norm: Tensor, eps: float = 1e-6) -> Tensor:
    """The factor of a norm clip that acts only above its maximum: ``max_norm / (norm + eps)`` when
    ``norm > max_norm``, else exactly 1 (ZClip's and AutoClip's papers; torch's ``clip_grad_norm_``
    always multiplies, so a norm equal to its maximum would read as clipped). 0-dim tensors, the factor in
    their dtype (an inf maximum: 1)."""
    return torch.where(norm > max_norm, max_norm / (norm + eps), 1.0)


def clip_grad_value_(
    parameters: ParamsLike, max: float, min: Optional[float] = None, skip: Optional[Tensor] = None
) -> None:
    """Clamp every gradient element into ``[min, max]`` in place (``min`` defaults to ``-max``).

    ``skip``: a 0-dim bool tensor; where true every gradient is left as it is (the bounds widen to +-inf on
    the device, so a step that will be skipped is decided without a host read).
    """
    low = -max if min is None else min
    if not low <= max:
        raise ValueError(f"clip_grad_value_ needs min <= max, got min={low}, max={max}")
    if skip is not None:  # 0-dim bounds on the device: +-inf where skipped
        low, max = torch.where(skip, -math.inf, low), torch.where(skip, math.inf, max)
    for _, p in _named_with_grad(parameters):
        if skip is None:
            p.grad.clamp_(min=low, max=max)
        else:
            p.grad.clamp_(min=low.to(p.grad), max=max.to(p.grad))


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
    skip: Optional[Tensor] = None,
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
      skip: a 0-dim bool tensor; where true no unit is clipped (a step that will be skipped, decided on the
        device).

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
        if skip is not None:
            clip_mask = clip_mask & ~skip.to(clip_mask.device)
        scale = torch.where(clip_mask, max_norm / grad_norm.clamp(min=1e-6), torch.ones_like(grad_norm))
        p.grad.mul_(scale.to(p.grad.dtype))
        num_units += clip_mask.numel()
        clipped_here = clip_mask.sum().float()
        num_clipped = clipped_here if num_clipped is None else num_clipped + clipped_here.to(num_clipped.device)
    if num_clipped is None:
        return torch.tensor(0.0)
    return num_clipped / num_units
