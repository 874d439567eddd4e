"""The lattice recursion of k2's ``mutual_information.py`` and the ``boundary`` helpers, in pure PyTorch.

Part of :mod:`icefall_lite.nn.rnnt_loss` (which re-exports the public names and
states the lattice conventions): :func:`make_boundary` builds the ``(B, 4)``
boundary from lengths; :func:`mutual_information_recursion` is the recursion
every RNN-T loss reduces to, with an analytic backward.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

import torch

Tensor = torch.Tensor

__all__ = ["make_boundary", "mutual_information_recursion"]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------
# boundary helpers
# --------------------------------------------------------------------------


def make_boundary(symbol_lengths: Tensor, frame_lengths: Tensor) -> Tensor:
    """Build a k2 ``boundary`` from per-sequence lengths.

    Args:
      symbol_lengths: ``(B,)`` integer, number of target symbols ``U_b``
        (without blank / SOS).
      frame_lengths: ``(B,)`` integer, number of encoder frames ``T_b``.

    Returns:
      ``(B, 4)`` int64 on the device of ``frame_lengths``, rows
      ``[0, 0, U_b, T_b]`` = ``[s_begin, t_begin, s_end, t_end]``.
    """
    if symbol_lengths.shape != frame_lengths.shape or symbol_lengths.ndim != 1:
        raise ValueError(
            "make_boundary: symbol_lengths and frame_lengths must both be (B,), "
            f"got {tuple(symbol_lengths.shape)} and {tuple(frame_lengths.shape)}"
        )
    device = frame_lengths.device
    boundary = torch.zeros((frame_lengths.shape[0], 4), dtype=torch.int64, device=device)
    boundary[:, 2] = symbol_lengths.to(device=device, dtype=torch.int64)
    boundary[:, 3] = frame_lengths.to(dtype=torch.int64)
    return boundary


def _default_boundary(B: int, S: int, T: int, device: torch.device) -> Tensor:
    """``(B, 4)`` int64 rows ``[0, 0, S, T]``."""
    boundary = torch.zeros((B, 4), dtype=torch.int64, device=device)
    boundary[:, 2] = S
    boundary[:, 3] = T
    return boundary


def _check_boundary(boundary: Tensor, B: int, S: int, T: int) -> List[List[int]]:
    """Validate ``boundary`` ``(B, 4)`` against lattice size ``S x T``.

    Returns it as a Python list (one host sync), used for loop bounds.
    """
    if boundary.shape != (B, 4):
        raise ValueError(f"boundary must have shape ({B}, 4), got {tuple(boundary.shape)}")
    if boundary.dtype != torch.int64:
        raise ValueError(f"boundary must be int64, got {boundary.dtype}")
    rows = boundary.tolist()
    for b, (s0, t0, s1, t1) in enumerate(rows):
        if not (0 <= s0 <= s1 <= S and 0 <= t0 <= t1 <= T):
            raise ValueError(
                f"boundary[{b}] = {[s0, t0, s1, t1]} is not a valid "
                f"[s_begin, t_begin, s_end, t_end] for S={S}, T={T}: need "
                "0 <= s_begin <= s_end <= S and 0 <= t_begin <= t_end <= T"
            )
    return rows


def _fix_for_boundary(px: Tensor, boundary: Optional[Tensor]) -> Tensor:
    """Set ``px[b, :, t_end_b] = -inf`` (no symbol after the last frame).

    Args:
      px: ``(B, S, T+1)``; column ``T`` is already ``-inf``.
      boundary: ``(B, 4)`` or None (then nothing to do).
    Returns:
      ``(B, S, T+1)`` (a new tensor; autograd-safe).
    """
    if boundary is None:
        return px
    B, S, T1 = px.shape
    t_end = boundary[:, 3].reshape(B, 1, 1).expand(B, S, 1)
    return px.scatter(2, t_end, _NEG_INF)


# --------------------------------------------------------------------------
# mutual-information recursion
# --------------------------------------------------------------------------
#
# Cells (s, t) are processed one anti-diagonal d = s + t at a time.  All
# lattice quantities are stored "skewed" as (D, B, S+3) tensors, D = S+T+1:
#
#     Z[d, b, s+1] = z[b, s, d - s]        (-inf where d - s is out of range)
#
# Columns 0 and S+2 are permanent -inf padding, so that both neighbours of a
# cell, (s-1, t) and (s, t-1) [forward] or (s+1, t) and (s, t+1) [backward],
# lie on diagonal d-1 [d+1] at column offsets -1/0 [+1/0]: each diagonal is one
# batched logaddexp over contiguous memory.


def _skew(x: Tensor, S: int, D: int) -> Tensor:
    """Skew a lattice tensor.

    Args:
      x: ``(B, R, W)``, ``R <= S + 1`` rows (symbol index ``s``) and ``W``
        columns (frame index ``t``).
      S: number of symbols of the lattice.
      D: number of diagonals, ``S + T + 1``.
    Returns:
      ``(D, B, S+3)`` with ``out[d, b, s+1] = x[b, s, d-s]`` and ``-inf``
      wherever ``d-s`` is not in ``[0, W)`` or ``s >= R``.
    """
    B, R, W = x.shape
    device = x.device
    out = torch.full((D, B, S + 3), _NEG_INF, dtype=x.dtype, device=device)
    if R == 0 or W == 0:
        return out
    x_pad = torch.cat([x, torch.full((B, R, 1), _NEG_INF, dtype=x.dtype, device=device)], dim=2)
    d_idx = torch.arange(D, device=device).unsqueeze(1)  # (D, 1)
    s_idx = torch.arange(R, device=device).unsqueeze(0)  # (1, R)
    t_idx = d_idx - s_idx  # (D, R)
    t_idx = torch.where((t_idx >= 0) & (t_idx < W), t_idx, torch.full_like(t_idx, W))
    gathered = x_pad[:, s_idx.expand(D, R), t_idx]  # (B, D, R)
    out[:, :, 1 : R + 1] = gathered.permute(1, 0, 2)
    return out


def _unskew(z: Tensor, R: int, W: int) -> Tensor:
    """Inverse of :func:`_skew` for the cells of an ``R x W`` grid.

    Args:
      z: ``(D, B, S+1)``, the skewed tensor without its padding columns
        (``z[d, b, s] <-> cell (s, d-s)``).
    Returns:
      ``(B, R, W)`` with ``out[b, s, t] = z[s+t, b, s]``.
    """
    device = z.device
    s_idx = torch.arange(R, device=device).unsqueeze(1).expand(R, W)
    d_idx = s_idx + torch.arange(W, device=device).unsqueeze(0)
    return z[d_idx, :, s_idx].permute(2, 0, 1).contiguous()  # (R, W, B) -> (B, R, W)


def _group_by_diagonal(rows: List[List[int]], s_col: int, t_col: int) -> Dict[int, Tuple[List[int], List[int]]]:
    """Map diagonal ``s+t`` -> (batch indices, skewed columns ``s+1``)."""
    groups: Dict[int, Tuple[List[int], List[int]]] = {}
    for b, row in enumerate(rows):
        s, t = row[s_col], row[t_col]
        bs, cols = groups.setdefault(s + t, ([], []))
        bs.append(b)
        cols.append(s + 1)
    return groups


def _neighbour_view(buf: Tensor, i: int, S: int) -> Tensor:
    """The two predecessor terms of every direction's diagonal ``i``, as one strided view.

    ``buf`` is ``(D, K, B, S+3)`` (K = 1: forward only; K = 2: forward and
    backward) and row ``i - 1`` holds every direction's previous diagonal. The
    forward step reads columns ``[0, S]`` (cell (s-1, t)) and ``[1, S+1]``
    (cell (s, t-1)); the backward step, stored reversed, reads ``[1, S+1]``
    (cell (s, t+1)) and ``[2, S+2]`` (cell (s+1, t)). Both pairs are two
    windows one element apart, and direction k's pair starts k elements
    further, so the whole read is one overlapping view.

    Returns:
      ``(K, 2, B, S+1)`` view of ``buf[i - 1]``: ``[k, j, b, s] = buf[i-1, k, b, s + j + k]``.
    """
    _, K, B, W = buf.shape
    return buf.as_strided((K, 2, B, S + 1), (B * W + 1, 1, W, 1), buf.storage_offset() + (i - 1) * K * B * W)


def _neighbour_arcs(PX: Tensor, PY: Tensor, S: int, d_last: int, with_backward: bool) -> Tensor:
    """The arc scores that go with :func:`_neighbour_view`, laid out to be added to it in one op.

    Args:
      PX, PY: skewed ``(D, B, S+3)`` arc scores (:func:`_skew`).
    Returns:
      ``(d_last, K, 2, B, S+1)``, row ``i - 1`` for step ``i``: forward (k = 0)
      ``px`` of arc (s-1, t) -> (s, t) and ``py`` of (s, t-1) -> (s, t) on
      diagonal ``i - 1``; backward (k = 1) ``py`` of (s, t) -> (s, t+1) and
      ``px`` of (s, t) -> (s+1, t) on diagonal ``e = d_last - i``.
    """
    forward = torch.stack([PX[:d_last, :, 0 : S + 1], PY[:d_last, :, 1 : S + 2]], dim=1)  # (d_last, 2, B, S+1)
    if not with_backward:
        return forward.unsqueeze(1)
    e = torch.arange(d_last - 1, -1, -1, device=PX.device)  # diagonal of the backward step i = 1 .. d_last
    backward = torch.stack([PY[e, :, 1 : S + 2], PX[e, :, 1 : S + 2]], dim=1)
    return torch.stack([forward, backward], dim=1)


def _mutual_information(
    px: Tensor, py: Tensor, boundary: Tensor, with_grad: bool
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Forward (and optionally backward) lattice recursion, no autograd.

    Step ``i`` computes the forward scores of diagonal ``i`` and, with
    ``with_grad``, the backward scores of diagonal ``d_last - i`` (independent
    of each other): one add of the predecessors' scores and the arc scores
    for both directions, and one logaddexp -- two kernel launches per step
    instead of three per direction.

    Args:
      px: ``(B, S, T+1)``; py: ``(B, S+1, T)``; boundary: ``(B, 4)`` int64.
      with_grad: also compute the occupancy posteriors.
    Returns:
      ``scores`` ``(B,)`` = ``p[b, s_end, t_end]``, and if ``with_grad``
      ``px_grad`` ``(B, S, T+1)`` = d score / d px and ``py_grad``
      ``(B, S+1, T)`` = d score / d py (else None, None).  Sequences with
      score ``-inf`` get all-zero posteriors.
    """
    B, S, T1 = px.shape
    T = T1 - 1
    rows = _check_boundary(boundary, B, S, T)
    D = S + T + 1
    device, dtype = px.device, px.dtype

    PX = _skew(px, S, D)  # (D, B, S+3); column S+1 stays -inf (no px row S)
    PY = _skew(py, S, D)
    starts = _group_by_diagonal(rows, 0, 1)
    ends = _group_by_diagonal(rows, 2, 3)
    d_last = max(ends) if ends else 0  # no cell beyond this diagonal matters

    # buf[i, 0] = alpha of diagonal i: alpha[d, b, s+1] = p[b, s, d-s];
    # buf[i, 1] = beta of diagonal d_last - i: log-sum over paths from (s, d-s) to the end.
    K = 2 if with_grad else 1
    buf = torch.full((d_last + 1, K, B, S + 3), _NEG_INF, dtype=dtype, device=device)
    arcs = _neighbour_arcs(PX, PY, S, d_last, with_grad)
    scratch = torch.empty((K, 2, B, S + 1), dtype=dtype, device=device)
    cells = buf[:, :, :, 1 : S + 2].unbind(0)  # (K, B, S+1) per step
    for i in range(d_last + 1):
        if i > 0:
            torch.add(_neighbour_view(buf, i, S), arcs[i - 1], out=scratch)
            torch.logaddexp(scratch[:, 0], scratch[:, 1], out=cells[i])
        if i in starts:
            bs, cols = starts[i]
            buf[i, 0, bs, cols] = 0.0
        if with_grad and d_last - i in ends:
            bs, cols = ends[d_last - i]
            buf[i, 1, bs, cols] = 0.0

    alpha = buf[:, 0]  # (d_last + 1, B, S+3)
    end_d = boundary[:, 2] + boundary[:, 3]
    batch = torch.arange(B, device=device)
    scores = alpha[end_d, batch, boundary[:, 2] + 1]  # (B,)
    if not with_grad:
        return scores, None, None

    # ---- posteriors: exp(alpha + arc + beta(next) - total); -inf total -> 0
    beta = torch.full((D + 1, B, S + 3), _NEG_INF, dtype=dtype, device=device)
    beta[: d_last + 1] = buf[:, 1].flip(0)
    total = torch.where(scores == _NEG_INF, torch.zeros_like(scores), scores)
    total = total.reshape(1, B, 1)
    a = torch.full((D, B, S + 1), _NEG_INF, dtype=dtype, device=device)
    a[: d_last + 1] = alpha[:, :, 1 : S + 2]
    gx = (a + PX[:, :, 1 : S + 2] + beta[1:, :, 2 : S + 3] - total).exp()
    gy = (a + PY[:, :, 1 : S + 2] + beta[1:, :, 1 : S + 2] - total).exp()
    px_grad = _unskew(gx, S, T + 1)
    py_grad = _unskew(gy, S + 1, T)
    return scores, px_grad, py_grad


class _MutualInformationFunction(torch.autograd.Function):
    """Autograd wrapper: forward computes scores and posteriors; backward is
    ``grad_score[b] * posterior`` (no per-step graph is stored)."""

    @staticmethod
    def forward(ctx, px: Tensor, py: Tensor, boundary: Tensor):  # type: ignore[override]
        scores, px_grad, py_grad = _mutual_information(px, py, boundary, with_grad=True)
        ctx.save_for_backward(px_grad, py_grad)
        ctx.mark_non_differentiable(px_grad, py_grad)
        return scores, px_grad, py_grad

    @staticmethod
    def backward(ctx, grad_scores: Tensor, _g1: Tensor, _g2: Tensor):  # type: ignore[override]
        px_grad, py_grad = ctx.saved_tensors
        g = grad_scores.reshape(-1, 1, 1)
        return g * px_grad, g * py_grad, None


def mutual_information_recursion(
    px: Tensor,
    py: Tensor,
    boundary: Optional[Tensor] = None,
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """Log-sum over all monotone lattice paths (k2's mutual-information recursion).

    ``p[b, s_begin, t_begin] = 0`` and::

        p[b, s, t] = logaddexp(p[b, s-1, t] + px[b, s-1, t],
                               p[b, s, t-1] + py[b, s, t-1])

    (terms with an index below the begin corner are absent).

    The recursion runs one anti-diagonal ``s + t`` at a time (a Python loop of
    ``S + T + 1`` steps of two batched tensor ops), the backward recursion in
    the same steps; the gradient is computed analytically from the two, so
    memory is ``O(B * S * T)``.

    Args:
      px: ``(B, S, T+1)`` float32/float64, symbol-arc log-scores.  For RNN-T
        ``px[:, :, T]`` (and ``px[b, :, t_end_b]``) should be ``-inf``.
      py: ``(B, S+1, T)`` same dtype/device, frame-arc log-scores.
      boundary: ``(B, 4)`` int64 ``[s_begin, t_begin, s_end, t_end]``;
        None means ``[0, 0, S, T]``.
      return_grad: also return ``(px_grad, py_grad)``, shapes of ``px``/``py``:
        ``d scores[b] / d px[b]`` and ``d scores[b] / d py[b]``, i.e. the
        posterior occupancy of every arc (zero for unreachable arcs and for
        sequences whose score is ``-inf``).  These are detached.

    Returns:
      ``scores`` ``(B,)`` = ``p[b, s_end, t_end]``, or
      ``(scores, (px_grad, py_grad))`` if ``return_grad``.  ``scores`` is
      differentiable w.r.t. ``px`` and ``py``.
    """
    if px.ndim != 3 or py.ndim != 3:
        raise ValueError(f"px and py must be 3-D, got {tuple(px.shape)} and {tuple(py.shape)}")
    B, S, T1 = px.shape
    T = T1 - 1
    if py.shape != (B, S + 1, T):
        raise ValueError(
            f"py must have shape (B, S+1, T) = {(B, S + 1, T)} for px of shape {tuple(px.shape)}, got {tuple(py.shape)}"
        )
    if px.dtype != py.dtype or px.device != py.device:
        raise ValueError("px and py must have the same dtype and device")
    if not px.is_floating_point():
        raise ValueError(f"px must be floating point, got {px.dtype}")
    if boundary is None:
        boundary = _default_boundary(B, S, T, px.device)
    else:
        boundary = boundary.to(device=px.device, dtype=torch.int64)
    px_c, py_c = px.contiguous(), py.contiguous()

    needs_autograd = torch.is_grad_enabled() and (px.requires_grad or py.requires_grad)
    if needs_autograd:
        scores, px_grad, py_grad = _MutualInformationFunction.apply(px_c, py_c, boundary)
    else:
        with torch.no_grad():
            scores, px_grad, py_grad = _mutual_information(px_c, py_c, boundary, return_grad)
    if return_grad:
        assert px_grad is not None and py_grad is not None
        return scores, (px_grad, py_grad)
    return scores
