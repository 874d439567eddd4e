"""The lattice recursions of k2's ``mutual_information.py`` and the ``boundary`` helpers, in pure PyTorch.

Part of :mod:`icefall_lite.nn.rnnt_loss` (which re-exports the public names and
states the lattice conventions): :func:`make_boundary` builds the ``(B, 4)``
boundary from lengths (:mod:`icefall_lite.nn.boundary`, re-exported here as k2's
module has it); :func:`mutual_information_recursion` is the recursion
every RNN-T loss reduces to (k2's arguments, shapes and results, for the
regular and the modified lattice), with an analytic backward computed in
float64 whatever the input dtype: on the CPU by the PyTorch recursion of
:mod:`icefall_lite.nn.mutual_information_pytorch`, on CUDA by the Triton kernel of
:mod:`icefall_lite.nn.mutual_information_triton` (``BACKEND``);
:func:`joint_mutual_information_recursion`
splits the total score into the contributions of several ``px``/``py`` terms.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from icefall_lite.nn.boundary import default_boundary, fix_for_boundary, make_boundary
from icefall_lite.nn.mutual_information_pytorch import _mutual_information

Tensor = torch.Tensor

__all__ = ["make_boundary", "fix_for_boundary", "mutual_information_recursion", "joint_mutual_information_recursion"]


class _MutualInformationFunction(torch.autograd.Function):
    """Autograd wrapper: forward computes scores and posteriors (by ``compute``, an implementation of
    :func:`_mutual_information`); backward is ``grad_score[b] * posterior`` (no per-step graph is stored)."""

    @staticmethod
    def forward(ctx, px: Tensor, py: Tensor, boundary: Tensor, compute: Callable):  # type: ignore[override]
        scores, px_grad, py_grad = compute(px, py, boundary, True)
        ctx.save_for_backward(px_grad, py_grad)
        ctx.mark_non_differentiable(px_grad, py_grad)
        return scores, px_grad, py_grad

    @staticmethod
    def backward(ctx, grad_scores: Tensor, _g1: Tensor, _g2: Tensor):  # type: ignore[override]
        px_grad, py_grad = ctx.saved_tensors
        g = grad_scores.reshape(-1, 1, 1)
        return g * px_grad, g * py_grad, None, None


# Which implementation runs the recursion: "auto" takes the Triton kernel
# (icefall_lite.nn.mutual_information_triton) for CUDA tensors when Triton
# imports, and the PyTorch recursion (icefall_lite.nn.mutual_information_pytorch:
# the CPU path, and the kernel's oracle) otherwise; "pytorch" or "triton" forces one (tests and benchmarks set
# it; the kernel on CPU tensors needs TRITON_INTERPRET=1 set before it is first
# imported).
BACKEND = "auto"
_BACKENDS = ("auto", "pytorch", "triton")


@functools.lru_cache(maxsize=None)
def _triton_kernel() -> Optional[Callable]:
    """The kernel's entry point, or None where Triton is not installed. Imported on first use: Triton is
    optional, and the kernel module builds on this one's helpers."""
    try:
        from icefall_lite.nn.mutual_information_triton import mutual_information_kernel
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        return None
    return mutual_information_kernel


def triton_available() -> bool:
    """Whether the Triton kernel can run here (Triton is installed)."""
    return _triton_kernel() is not None


def _implementation(device: torch.device) -> Callable:
    """The function that computes the recursion for tensors on ``device``, as ``BACKEND`` says."""
    if BACKEND not in _BACKENDS:
        raise ValueError(f"mutual_information.BACKEND must be one of {_BACKENDS}, got {BACKEND!r}")
    if BACKEND == "pytorch" or (BACKEND == "auto" and device.type != "cuda"):
        return _mutual_information
    kernel = _triton_kernel()
    if kernel is not None:
        return kernel
    if BACKEND == "triton":
        raise RuntimeError("mutual_information.BACKEND is 'triton', but Triton is not installed (pip install triton)")
    return _mutual_information


def _check_px_py(px: Tensor, py: Tensor) -> Tuple[int, int, int]:
    """Validate ``px`` ``(B, S, T+1)`` or ``(B, S, T)`` against ``py`` ``(B, S+1, T)``; returns ``(B, S, T)``."""
    if px.ndim != 3 or py.ndim != 3:
        raise ValueError(f"px and py must be 3-D, got {tuple(px.shape)} and {tuple(py.shape)}")
    B, S, T1 = px.shape
    T = py.shape[2]
    if py.shape != (B, S + 1, T) or T1 not in (T, T + 1):
        raise ValueError(
            f"py must be (B, S+1, T) and px (B, S, T+1) (regular) or (B, S, T) (modified); "
            f"got px {tuple(px.shape)}, py {tuple(py.shape)}"
        )
    if px.dtype != py.dtype or px.device != py.device:
        raise ValueError("px and py must have the same dtype and device")
    if not px.is_floating_point():
        raise ValueError(f"px must be floating point, got {px.dtype}")
    return B, S, T


def upcast_half(x: Any) -> Any:
    """``x`` in float32 when it is a float16/bfloat16 tensor, else unchanged (gradients flow back through the
    cast in ``x``'s own dtype)."""
    return x.float() if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16) else x


def mutual_information_recursion(
    px: Tensor,
    py: Tensor,
    boundary: Optional[Tensor] = None,
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """Log-sum over all monotone lattice paths (k2's ``mutual_information_recursion``).

    ``p[b, s_begin, t_begin] = 0`` and, regular (``px`` of ``T+1`` columns)::

        p[b, s, t] = logaddexp(p[b, s-1, t] + px[b, s-1, t],
                               p[b, s, t-1] + py[b, s, t-1])

    or modified (``px`` of ``T`` columns: a symbol also consumes a frame)::

        p[b, s, t] = logaddexp(p[b, s-1, t-1] + px[b, s-1, t-1],
                               p[b, s, t-1] + py[b, s, t-1])

    (terms with an index below the begin corner are absent).

    The forward and the backward recursion run together, one step at a time
    (an anti-diagonal ``s + t``, or a frame for the modified lattice), two
    batched tensor ops per step; the occupancy posteriors are then
    ``exp(alpha + arc + beta - total)``.  Everything runs in float64 and only
    the results are cast back: float32 log-scores of a long lattice are
    large (~1000), and their rounding made float32 posteriors wrong by ~1e-4
    relative (issue 28); in float64 they are exact to float32 precision and
    each sequence's posteriors sum to its number of symbols and frames.
    Memory is ``O(B * S * (S + T))``.  That is the CPU path; CUDA tensors go
    to a Triton kernel that computes the same (forward and backward as
    separate programs of each sequence, in float64), as ``BACKEND`` says.

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified),
        float32/float64, symbol-arc log-scores (float16/bfloat16 are cast to
        float32 first: their posteriors would be flushed to zero).  For regular RNN-T
        ``px[:, :, T]`` (and ``px[b, :, t_end_b]``) should be ``-inf``.
      py: ``(B, S+1, T)`` same dtype/device, frame-arc log-scores.
      boundary: ``(B, 4)`` int64 ``[s_begin, t_begin, s_end, t_end]`` with
        ``0 <= s_begin <= s_end <= S`` and ``0 <= t_begin <= t_end <= T``;
        None means ``[0, 0, S, T]``.
      return_grad: also return ``(px_grad, py_grad)``, shapes of ``px``/``py``:
        ``d scores[b] / d px[b]`` and ``d scores[b] / d py[b]``, i.e. the
        posterior occupancy of every arc (zero for arcs outside the boundary,
        for sequences whose score is ``-inf``, and where it is below
        ``2**24`` times the dtype's smallest normal number, ~2e-31 in
        float32, as a denormal would slow every op on it).  These are detached.

    Returns:
      ``scores`` ``(B,)`` = ``p[b, s_end, t_end]``, or
      ``(scores, (px_grad, py_grad))`` if ``return_grad``.  ``scores`` is
      differentiable w.r.t. ``px`` and ``py``.
    """
    px, py = upcast_half(px), upcast_half(py)
    B, S, T = _check_px_py(px, py)
    if boundary is None:
        boundary = default_boundary(B, S, T, px.device)
    else:
        boundary = boundary.to(device=px.device, dtype=torch.int64)
    px_c, py_c = px.contiguous(), py.contiguous()

    compute = _implementation(px.device)
    needs_autograd = torch.is_grad_enabled() and (px.requires_grad or py.requires_grad)
    if needs_autograd:
        scores, px_grad, py_grad = _MutualInformationFunction.apply(px_c, py_c, boundary, compute)
    else:
        with torch.no_grad():
            scores, px_grad, py_grad = compute(px_c, py_c, boundary, return_grad)
    if return_grad:
        assert px_grad is not None and py_grad is not None
        return scores, (px_grad, py_grad)
    return scores


def joint_mutual_information_recursion(
    px: Sequence[Tensor],
    py: Sequence[Tensor],
    boundary: Optional[Tensor] = None,
) -> Tensor:
    """The recursion on ``sum(px)``, ``sum(py)``, with its total split by term (k2's function of this name).

    Every ``px[n]`` has the shape of a ``px`` of
    :func:`mutual_information_recursion` (``(B, S, T+1)`` or ``(B, S, T)``),
    every ``py[n]`` ``(B, S+1, T)``.  With ``g_x``, ``g_y`` the arc
    occupancies of the summed lattice, term ``n`` contributes
    ``sum(g_x * px[n]) + sum(g_y * py[n])``; the difference between the total
    log-score and the sum of these (log-of-sum against sum-of-logs) is added
    to term 0.

    Args:
      px: a non-empty sequence of ``N`` tensors of one shape.
      py: a sequence of ``N`` tensors of one shape.
      boundary: ``(B, 4)`` int64 or None, as in :func:`mutual_information_recursion`.
    Returns:
      ``(N, B)``, summing over dim 0 to the total log-score of each sequence.
      Its gradient w.r.t. ``px[n]`` is the occupancy ``g_x`` (times the
      incoming gradient of row ``n``), likewise for ``py[n]``.
    """
    N = len(px)
    if N == 0 or len(py) != N:
        raise ValueError(f"px and py must be sequences of the same non-zero length, got {len(px)} and {len(py)}")
    px_all = torch.stack(list(px), dim=0)  # (N, B, S, T1)
    py_all = torch.stack(list(py), dim=0)  # (N, B, S+1, T)
    with torch.no_grad():
        total, (px_occ, py_occ) = mutual_information_recursion(
            px_all.sum(dim=0), py_all.sum(dim=0), boundary, return_grad=True
        )
    lowest = torch.finfo(px_all.dtype).min  # -inf * 0 occupancy would be nan
    x_part = torch.einsum("nbst,bst->nb", px_all.clamp(min=lowest), px_occ)
    y_part = torch.einsum("nbst,bst->nb", py_all.clamp(min=lowest), py_occ)
    parts = x_part + y_part  # (N, B)
    offset = (total - parts.detach().sum(dim=0)).unsqueeze(0)  # (1, B), no gradient
    return torch.cat([parts[:1] + offset, parts[1:]], dim=0)
