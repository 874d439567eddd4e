"""k2's mutual-information recursion as one Triton kernel: for the GPU, where the PyTorch recursion
(:mod:`icefall_lite.nn.mutual_information`) launches several kernels per lattice step and reads its
boundary on the host.

One program per sequence walks its lattice step by step (an anti-diagonal ``s + t``, or a frame for the
modified lattice), the cells of a step side by side, first forward (``alpha``) and then backward (``beta``),
both in float64 as the PyTorch recursion computes them; the arc posteriors ``exp(alpha + arc + beta - total)``
are then a few tensor ops. No host synchronisation: the boundary is read on the device, and its checks are
device-side asserts. Results equal :func:`icefall_lite.nn.mutual_information.mutual_information_recursion`'s
(the oracle: ``tests/test_mutual_information_triton.py`` runs the kernel in Triton's interpreter on the CPU).

Needs Triton (part of PyTorch's CUDA wheels; ``pip install triton`` elsewhere on Linux); with
``TRITON_INTERPRET=1`` set before this module is imported, it runs on CPU tensors too.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from icefall_lite.nn.boundary import NEG_INF, default_boundary
from icefall_lite.nn.mutual_information import (
    _check_px_py,
    _flush_below,
    _MutualInformationFunction,
    upcast_half,
)

Tensor = torch.Tensor

__all__ = ["mutual_information_recursion_triton"]


@triton.jit
def _logaddexp(a, b):
    m = tl.maximum(a, b)
    finite = (m != float("-inf")) & (m != float("inf"))
    shift = tl.where(finite, m, 0.0)
    total = tl.where(finite, tl.exp(a - shift) + tl.exp(b - shift), 1.0)  # no log(0) where both are -inf
    return tl.where(finite, shift + tl.log(total), m)  # -inf + -inf, or an overflow to +inf, as torch's


STRIDES = ["stride_xb", "stride_xs", "stride_xt", "stride_yb", "stride_ys", "stride_yt"]
STRIDES += ["stride_ab", "stride_as", "stride_at"]


# Strides not specialised: one compilation for every batch shape. The loop reads what its last step stored:
# no software pipelining (num_stages=1 at the launch) may move a load above that step's barrier.
@triton.jit(do_not_specialize=STRIDES)
def _alpha_beta_kernel(
    px_ptr,
    py_ptr,
    boundary_ptr,
    alpha_ptr,
    beta_ptr,
    stride_xb,
    stride_xs,
    stride_xt,
    stride_yb,
    stride_ys,
    stride_yt,
    stride_ab,
    stride_as,
    stride_at,
    MODIFIED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``b`` fills ``alpha[b]`` and ``beta[b]`` (``(S+1, T+1)``, float64, -inf outside the boundary
    box, as the caller made them) over the box ``[s_begin, s_end] x [t_begin, t_end]``."""
    b = tl.program_id(0)
    s_begin = tl.load(boundary_ptr + 4 * b)
    t_begin = tl.load(boundary_ptr + 4 * b + 1)
    s_end = tl.load(boundary_ptr + 4 * b + 2)
    t_end = tl.load(boundary_ptr + 4 * b + 3)
    px = px_ptr + b * stride_xb
    py = py_ptr + b * stride_yb
    alpha = alpha_ptr + b * stride_ab
    beta = beta_ptr + b * stride_ab
    s = tl.arange(0, BLOCK)
    in_s = (s >= s_begin) & (s <= s_end)
    if MODIFIED:
        first = t_begin
        last = t_end
    else:
        first = s_begin + t_begin
        last = s_end + t_end

    tl.store(alpha + s_begin * stride_as + t_begin * stride_at, 0.0)
    tl.debug_barrier()
    for d in range(first + 1, last + 1):
        if MODIFIED:
            t = s * 0 + d
        else:
            t = d - s
        cell = in_s & (t >= t_begin) & (t <= t_end)
        from_py = cell & (t > t_begin)
        if MODIFIED:  # the px arc comes from (s-1, t-1)
            from_px = from_py & (s > s_begin)
            t_px = t - 1
        else:  # from (s-1, t)
            from_px = cell & (s > s_begin)
            t_px = t
        a = tl.load(alpha + (s - 1) * stride_as + t_px * stride_at, mask=from_px, other=float("-inf"))
        a += tl.load(px + (s - 1) * stride_xs + t_px * stride_xt, mask=from_px, other=float("-inf")).to(tl.float64)
        c = tl.load(alpha + s * stride_as + (t - 1) * stride_at, mask=from_py, other=float("-inf"))
        c += tl.load(py + s * stride_ys + (t - 1) * stride_yt, mask=from_py, other=float("-inf")).to(tl.float64)
        tl.store(alpha + s * stride_as + t * stride_at, _logaddexp(a, c), mask=cell)
        tl.debug_barrier()

    tl.store(beta + s_end * stride_as + t_end * stride_at, 0.0)
    tl.debug_barrier()
    for i in range(first, last):
        d = last - 1 - (i - first)
        if MODIFIED:
            t = s * 0 + d
        else:
            t = d - s
        cell = in_s & (t >= t_begin) & (t <= t_end)
        to_py = cell & (t < t_end)
        if MODIFIED:  # the px arc goes to (s+1, t+1)
            to_px = to_py & (s < s_end)
            t_next = t + 1
        else:  # to (s+1, t)
            to_px = cell & (s < s_end)
            t_next = t
        a = tl.load(beta + (s + 1) * stride_as + t_next * stride_at, mask=to_px, other=float("-inf"))
        a += tl.load(px + s * stride_xs + t * stride_xt, mask=to_px, other=float("-inf")).to(tl.float64)
        c = tl.load(beta + s * stride_as + (t + 1) * stride_at, mask=to_py, other=float("-inf"))
        c += tl.load(py + s * stride_ys + t * stride_yt, mask=to_py, other=float("-inf")).to(tl.float64)
        tl.store(beta + s * stride_as + t * stride_at, _logaddexp(a, c), mask=cell)
        tl.debug_barrier()


def _alpha_beta(px: Tensor, py: Tensor, boundary: Tensor, modified: bool) -> Tuple[Tensor, Tensor]:
    """The forward and backward scores ``(B, S+1, T+1)`` in float64, -inf outside each boundary box."""
    B, S1, T = py.shape
    alpha = torch.full((B, S1, T + 1), NEG_INF, dtype=torch.float64, device=px.device)
    beta = torch.full_like(alpha, NEG_INF)
    if B == 0:
        return alpha, beta
    _alpha_beta_kernel[(B,)](
        px,
        py,
        boundary,
        alpha,
        beta,
        *px.stride(),
        *py.stride(),
        *alpha.stride(),
        MODIFIED=modified,
        BLOCK=triton.next_power_of_2(S1),
        num_stages=1,
    )
    return alpha, beta


def _mutual_information(px: Tensor, py: Tensor, boundary: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Scores ``(B,)`` and the arc posteriors (shapes of ``px`` and ``py``): the oracle's results, with a
    sequence that has a NaN or ``+inf`` arc given a NaN score and NaN posteriors."""
    B, S, T = _check_px_py(px, py)
    modified = px.shape[2] == T
    broken = torch.isnan(px).flatten(1).any(1) | (px == float("inf")).flatten(1).any(1)
    broken |= torch.isnan(py).flatten(1).any(1) | (py == float("inf")).flatten(1).any(1)
    px = px.masked_fill(broken.reshape(B, 1, 1), NEG_INF)
    py = py.masked_fill(broken.reshape(B, 1, 1), NEG_INF)
    alpha, beta = _alpha_beta(px, py, boundary, modified)
    rows = torch.arange(B, device=px.device)
    scores = alpha[rows, boundary[:, 2], boundary[:, 3]]
    total = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores)).reshape(B, 1, 1)
    beta_px = beta[:, 1:, 1:] if modified else beta[:, 1:, :]
    px_grad = torch.exp(alpha[:, :S, : px.shape[2]] + px + beta_px - total).to(px.dtype)
    py_grad = torch.exp(alpha[:, :, :T] + py + beta[:, :, 1:] - total).to(py.dtype)
    nan = float("nan")
    flush = _flush_below(px.dtype)
    px_grad = torch.nn.functional.threshold(px_grad, flush, 0.0).masked_fill(broken.reshape(B, 1, 1), nan)
    py_grad = torch.nn.functional.threshold(py_grad, flush, 0.0).masked_fill(broken.reshape(B, 1, 1), nan)
    return scores.masked_fill(broken, nan).to(px.dtype), px_grad, py_grad


def _check_boundary_async(boundary: Tensor, B: int, S: int, T: int) -> None:
    """The boundary's shape on the host, its values by a device-side assert (no synchronisation): on the CPU a
    bad row raises a RuntimeError here; on CUDA it stops the process at the next synchronisation with "device-side
    assert triggered" (CUDA cannot go on after one), where the PyTorch recursion raises a ValueError."""
    if boundary.shape != (B, 4):
        raise ValueError(f"boundary must be (B, 4) = ({B}, 4), got {tuple(boundary.shape)}")
    s_begin, t_begin, s_end, t_end = boundary.unbind(1)
    ok = (0 <= s_begin) & (s_begin <= s_end) & (s_end <= S) & (0 <= t_begin) & (t_begin <= t_end) & (t_end <= T)
    torch._assert_async(ok.all(), "boundary rows must satisfy 0 <= s_begin <= s_end <= S, 0 <= t_begin <= t_end <= T")


class _MutualInformationTriton(_MutualInformationFunction):
    """Scores with their posteriors from the kernel; backward (the parent's) is ``grad_score[b] * posterior``."""

    @staticmethod
    def forward(ctx, px: Tensor, py: Tensor, boundary: Tensor):  # type: ignore[override]
        scores, px_grad, py_grad = _mutual_information(px, py, boundary)
        ctx.save_for_backward(px_grad, py_grad)
        ctx.mark_non_differentiable(px_grad, py_grad)
        return scores, px_grad, py_grad


def mutual_information_recursion_triton(
    px: Tensor, py: Tensor, boundary: Optional[Tensor] = None, return_grad: bool = False
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """:func:`icefall_lite.nn.mutual_information.mutual_information_recursion` (same arguments, shapes and
    results, regular and modified lattices) computed by one Triton kernel.

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified), float32/float64 (float16/bfloat16 are cast
        to float32); py: ``(B, S+1, T)``, same dtype and device.
      boundary: ``(B, 4)`` ``[s_begin, t_begin, s_end, t_end]``, or None for ``[0, 0, S, T]``.
      return_grad: also return ``(px_grad, py_grad)``, the arc posteriors (detached).
    Returns:
      ``scores`` ``(B,)``, or ``(scores, (px_grad, py_grad))``.
    """
    px, py = upcast_half(px), upcast_half(py)
    B, S, T = _check_px_py(px, py)
    if boundary is None:
        boundary = default_boundary(B, S, T, px.device)
    boundary = boundary.to(device=px.device, dtype=torch.int64).contiguous()
    _check_boundary_async(boundary, B, S, T)
    px_c, py_c = px.contiguous(), py.contiguous()
    if torch.is_grad_enabled() and (px.requires_grad or py.requires_grad):
        scores, px_grad, py_grad = _MutualInformationTriton.apply(px_c, py_c, boundary)
    else:
        with torch.no_grad():
            scores, px_grad, py_grad = _mutual_information(px_c, py_c, boundary)
    return (scores, (px_grad, py_grad)) if return_grad else scores
