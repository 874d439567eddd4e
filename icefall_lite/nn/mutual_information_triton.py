"""k2's mutual-information recursion as a Triton kernel: the recursion on CUDA tensors, where the PyTorch
recursion (:mod:`icefall_lite.nn.mutual_information`, the CPU path and this kernel's oracle) launches several
kernels per lattice step and reads its boundary on the host. :func:`mutual_information_recursion` dispatches
here (its ``BACKEND``); nothing else calls this module.

Two programs per sequence, launched together (grid ``B x 2``): program ``(b, 0)`` walks the lattice forward,
step by step (an anti-diagonal ``s + t``, or a frame for the modified lattice), the cells of a step side by
side, and fills ``alpha`` (k2's ``p``: log-sum over the paths from the begin cell); program ``(b, 1)`` walks it
backward from the end cell and fills ``beta`` (log-sum over the paths to the end cell). Neither reads the
other's results, so the serial chain of a sequence is its number of steps, not twice that; without gradients
only the forward programs run (grid ``B x 1``). The score is ``alpha`` at the end cell, and the arc posteriors
``exp(alpha + arc + beta(next cell) - score)`` are a few tensor ops. No host synchronisation: the boundary is
read on the device, its checks are device-side asserts.

Float64 scores, as the PyTorch recursion's: float32 ones were measured less accurate than k2's float32 loss.
The measure is benchmarks/bench_loss_versions.py's (its random inputs, V 500, scale 1): the relative error
(Frobenius norms) against float64 of the simple loss's gradient w.r.t. ``lm`` and ``am``, float32 in. Float32
scores as they come: 2.5e-4 (the PyTorch recursion's float32 version of issue 28, benchmarks/RESULTS.md
section 7). Float32 scores kept relative to each step's largest (the offsets summed in float64, the
posteriors put together in float64): at B 8 T 200 S 40 4.1e-6, 3.3e-6 and 5.4e-6 on three draws of the
inputs, at B 4 T 350 S 80 3.2e-6, 3.2e-5, 7.6e-6 and 4.8e-6 on four; k2's float32 loss: 7.5e-6 (issue 28's
filer, at B 8 T 200 S 40). This kernel in float64: 2.0e-7 and 2.9e-7 (first draws), the PyTorch recursion's
to the digits shown. Measured 2026-12-02
under ``TRITON_INTERPRET=1`` (numpy's exp and log; a GPU's approximate float32 ones round more) with a float32
variant of this kernel, not kept (its script is in issue 74's report).

Needs Triton (part of PyTorch's CUDA wheels; ``pip install triton`` elsewhere on Linux); with
``TRITON_INTERPRET=1`` set before this module is imported, it runs on CPU tensors too (the tests: see
``tests/test_mutual_information_triton.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from icefall_lite.nn.boundary import NEG_INF
from icefall_lite.nn.mutual_information_pytorch import _flush_below

Tensor = torch.Tensor

__all__ = ["mutual_information_kernel"]


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
    """Program ``(b, 0)`` fills ``alpha[b]``, program ``(b, 1)`` ``beta[b]`` (``(S+1, T+1)``, float64, -inf
    outside the boundary box, as the caller made them) over the box ``[s_begin, s_end] x [t_begin, t_end]``."""
    b = tl.program_id(0)
    s_begin = tl.load(boundary_ptr + 4 * b)
    t_begin = tl.load(boundary_ptr + 4 * b + 1)
    s_end = tl.load(boundary_ptr + 4 * b + 2)
    t_end = tl.load(boundary_ptr + 4 * b + 3)
    px = px_ptr + b * stride_xb
    py = py_ptr + b * stride_yb
    s = tl.arange(0, BLOCK)
    in_s = (s >= s_begin) & (s <= s_end)
    if MODIFIED:
        first = t_begin
        last = t_end
    else:
        first = s_begin + t_begin
        last = s_end + t_end

    if tl.program_id(1) == 0:
        alpha = alpha_ptr + b * stride_ab
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
    else:
        beta = beta_ptr + b * stride_ab
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


def _alpha_beta(
    px: Tensor, py: Tensor, boundary: Tensor, modified: bool, with_beta: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """The forward scores and, ``with_beta``, the backward ones (else None): ``(B, S+1, T+1)`` float64, -inf
    outside each boundary box."""
    B, S1, T = py.shape
    alpha = torch.full((B, S1, T + 1), NEG_INF, dtype=torch.float64, device=px.device)
    beta = torch.full_like(alpha, NEG_INF) if with_beta else None
    if B == 0:
        return alpha, beta
    _alpha_beta_kernel[(B, 2 if with_beta else 1)](
        px,
        py,
        boundary,
        alpha,
        alpha if beta is None else beta,  # not written by a grid of one column
        *px.stride(),
        *py.stride(),
        *alpha.stride(),
        MODIFIED=modified,
        BLOCK=triton.next_power_of_2(S1),
        num_stages=1,
    )
    return alpha, beta


def _check_boundary_async(boundary: Tensor, B: int, S: int, T: int) -> None:
    """The boundary's shape on the host, its values by a device-side assert (no synchronisation): on the CPU a
    bad row raises a RuntimeError here; on CUDA it stops the process at the next synchronisation with "device-side
    assert triggered" (CUDA cannot go on after one), where the PyTorch recursion raises a ValueError."""
    if boundary.shape != (B, 4):
        raise ValueError(f"boundary must be (B, 4) = ({B}, 4), got {tuple(boundary.shape)}")
    s_begin, t_begin, s_end, t_end = boundary.unbind(1)
    ok = (0 <= s_begin) & (s_begin <= s_end) & (s_end <= S) & (0 <= t_begin) & (t_begin <= t_end) & (t_end <= T)
    torch._assert_async(ok.all(), "boundary rows must satisfy 0 <= s_begin <= s_end <= S, 0 <= t_begin <= t_end <= T")


def mutual_information_kernel(
    px: Tensor, py: Tensor, boundary: Tensor, with_grad: bool
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The PyTorch recursion's ``_mutual_information`` (same arguments and results) by the kernel.

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified), float32/float64, contiguous;
      py: ``(B, S+1, T)``, same dtype and device, contiguous; boundary: ``(B, 4)`` int64 on their device.
      with_grad: also compute the arc posteriors (runs the backward programs).
    Returns:
      ``scores`` ``(B,)`` in ``px``'s dtype, and with ``with_grad`` ``px_grad``, ``py_grad`` (shapes of ``px``
      and ``py``) = d score / d arc, else None, None. A sequence whose score is ``-inf`` gets zero posteriors;
      one with a NaN or ``+inf`` arc a NaN score and NaN posteriors (computed with ``-inf`` arcs, then marked),
      the others untouched; posteriors at or below ``_flush_below(dtype)`` are zero.
    """
    B, S1, T = py.shape
    S = S1 - 1
    modified = px.shape[2] == T
    boundary = boundary.contiguous()
    _check_boundary_async(boundary, B, S, T)
    broken = torch.isnan(px).flatten(1).any(1) | (px == float("inf")).flatten(1).any(1)
    broken |= torch.isnan(py).flatten(1).any(1) | (py == float("inf")).flatten(1).any(1)
    px = px.masked_fill(broken.reshape(B, 1, 1), NEG_INF)
    py = py.masked_fill(broken.reshape(B, 1, 1), NEG_INF)
    alpha, beta = _alpha_beta(px, py, boundary, modified, with_beta=with_grad)
    scores = alpha[torch.arange(B, device=px.device), boundary[:, 2], boundary[:, 3]]
    nan = float("nan")
    if beta is None:
        return scores.masked_fill(broken, nan).to(px.dtype), None, None
    total = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores)).reshape(B, 1, 1)
    beta_px = beta[:, 1:, 1:] if modified else beta[:, 1:, :]
    px_grad = torch.exp(alpha[:, :S, : px.shape[2]] + px + beta_px - total).to(px.dtype)
    py_grad = torch.exp(alpha[:, :, :T] + py + beta[:, :, 1:] - total).to(py.dtype)
    flush = _flush_below(px.dtype)
    px_grad = torch.nn.functional.threshold(px_grad, flush, 0.0).masked_fill(broken.reshape(B, 1, 1), nan)
    py_grad = torch.nn.functional.threshold(py_grad, flush, 0.0).masked_fill(broken.reshape(B, 1, 1), nan)
    return scores.masked_fill(broken, nan).to(px.dtype), px_grad, py_grad
