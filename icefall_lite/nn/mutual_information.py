"""The lattice recursions of k2's ``mutual_information.py`` and the ``boundary`` helpers, in pure PyTorch.

Part of :mod:`icefall_lite.nn.rnnt_loss` (which re-exports the public names and
states the lattice conventions): :func:`make_boundary` builds the ``(B, 4)``
boundary from lengths; :func:`mutual_information_recursion` is the recursion
every RNN-T loss reduces to (k2's arguments, shapes and results, for the
regular and the modified lattice), with k2's backward: the forward scores,
then the occupancy of every arc propagated back from the end as a product of
local arc weights (never a difference of large log-scores);
:func:`joint_mutual_information_recursion` splits the total score into the
contributions of several ``px``/``py`` terms.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

Tensor = torch.Tensor

__all__ = ["make_boundary", "fix_for_boundary", "mutual_information_recursion", "joint_mutual_information_recursion"]

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
    boundary = torch.zeros(
        (frame_lengths.shape[0], 4), dtype=torch.int64, device=device
    )
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


def fix_for_boundary(px: Tensor, boundary: Optional[Tensor] = None) -> Tensor:
    """Set ``px[b, :, t_end_b] = -inf`` (no symbol after the last frame), as k2's
    ``fix_for_boundary`` (regular RNN-T only).

    Args:
      px: ``(B, S, T+1)``; column ``T`` is already ``-inf``.
      boundary: ``(B, 4)`` or None (then ``px`` is returned as it is).
    Returns:
      ``(B, S, T+1)``: a new tensor (k2 writes into ``px`` and returns it; here
      ``px`` is left alone, so the function is safe inside autograd graphs).
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
# Both lattices are processed one "step" at a time, where every arc leads from
# step d to step d + 1:
#
#   regular  (px (B, S, T+1)): step of cell (s, t) = s + t (anti-diagonals),
#            px[s, t]: (s, t) -> (s+1, t), py[s, t]: (s, t) -> (s, t+1);
#   modified (px (B, S, T)):   step of cell (s, t) = t (frames),
#            px[s, t]: (s, t) -> (s+1, t+1), py[s, t]: (s, t) -> (s, t+1).
#
# Lattice quantities are stored step-major as (D, B, S+3) tensors,
#
#     Z[d, b, s+1] = z[b, s, t]  for the cell (s, t) of step d  (-inf if none),
#
# with columns 0 and S+2 as permanent padding.  In both lattices the px arc
# into cell (d, c) comes from (d-1, c-1) and the py arc from (d-1, c), so a
# step of either recursion reads its predecessors as two contiguous windows of
# the previous step's row, one column apart.


# The dtype the recursions run in.  float32 scores of a long lattice are large
# (|p| ~ 1000 for an utterance), so float32 rounding of the stored scores
# (~3e-5 at 500) would show in every arc weight, and the arc weights and
# occupancies of cells far from the best paths fall below float32's normal
# range, where CPU arithmetic on subnormal numbers is many times slower.  The
# per-step tensors are only (2, B, S+3): float64 costs no measurable time.
_WORK_DTYPE = torch.float64


def _step_of(s: int, t: int, modified: bool) -> int:
    """Step index of cell ``(s, t)``."""
    return t if modified else s + t


def _num_steps(S: int, T: int, modified: bool) -> int:
    """Number of steps ``D`` of an ``(S+1) x (T+1)`` lattice."""
    return T + 1 if modified else S + T + 1


def _to_steps(x: Tensor, out: Tensor, modified: bool) -> None:
    """Write a lattice tensor into step-major layout.

    Args:
      x: ``(B, R, W)``, ``R <= S + 1`` rows (symbol index ``s``) and ``W``
        columns (frame index ``t``).
      out: ``(D, B, S+3)``, filled with ``-inf`` by the caller; receives
        ``out[d, b, s+1] = x[b, s, t]`` for ``d = step(s, t)``.
      modified: which lattice (see the comment above).
    """
    B, R, W = x.shape
    D = out.shape[0]
    if R == 0 or W == 0:
        return
    device = x.device
    x_pad = torch.cat([x, torch.full((B, R, 1), _NEG_INF, dtype=x.dtype, device=device)], dim=2)
    d_idx = torch.arange(D, device=device).unsqueeze(1)  # (D, 1)
    s_idx = torch.arange(R, device=device).unsqueeze(0)  # (1, R)
    t_idx = (d_idx + 0 * s_idx) if modified else (d_idx - s_idx)  # (D, R)
    t_idx = torch.where((t_idx >= 0) & (t_idx < W), t_idx, torch.full_like(t_idx, W))
    out[:, :, 1 : R + 1] = x_pad[:, s_idx.expand(D, R), t_idx].permute(1, 0, 2)


def _from_steps(z: Tensor, R: int, W: int, modified: bool, step_offset: int, col_offset: int) -> Tensor:
    """Read an ``R x W`` lattice tensor back from step-major layout.

    Args:
      z: ``(D', B, C)`` with ``D' > step(R-1, W-1) + step_offset`` and
        ``C > R - 1 + col_offset``.
    Returns:
      ``(B, R, W)`` with ``out[b, s, t] = z[step(s, t) + step_offset, b, s + col_offset]``.
    """
    device = z.device
    s_idx = torch.arange(R, device=device).unsqueeze(1).expand(R, W)
    t_idx = torch.arange(W, device=device).unsqueeze(0).expand(R, W)
    d_idx = t_idx if modified else s_idx + t_idx
    return z[d_idx + step_offset, :, s_idx + col_offset].permute(2, 0, 1).contiguous()  # (R, W, B) -> (B, R, W)


def _group_by_step(rows: List[List[int]], s_col: int, t_col: int, modified: bool) -> Dict[int, Tuple[List[int], List[int]]]:
    """Map step -> (batch indices, step-major columns ``s+1``) of one corner of every boundary row."""
    groups: Dict[int, Tuple[List[int], List[int]]] = {}
    for b, row in enumerate(rows):
        s, t = row[s_col], row[t_col]
        bs, cols = groups.setdefault(_step_of(s, t, modified), ([], []))
        bs.append(b)
        cols.append(s + 1)
    return groups


def _forward(arcs: Tensor, starts: Dict[int, Tuple[List[int], List[int]]], d_first: int, d_last: int) -> Tuple[Tensor, Tensor]:
    """The forward recursion: two tensor ops per step.

    Args:
      arcs: ``(D, 2, B, S+3)`` step-major ``px`` (``[:, 0]``) and ``py`` (``[:, 1]``).
      starts: step -> (batch indices, columns) of the begin cells.
      d_first, d_last: first and last step that matter.
    Returns:
      ``alpha`` ``(d_last+1, B, S+3)``, the forward log-scores (``p`` of k2), and
      ``terms`` ``(d_last+1, 2, B, S+3)`` = ``alpha[d] + arcs[d]``: the two
      terms every cell sends to the next step (kept for the arc weights).
    """
    _, _, B, W = arcs.shape
    S = W - 3
    alpha = torch.full((d_last + 1, B, W), _NEG_INF, dtype=arcs.dtype, device=arcs.device)
    terms = torch.full((d_last + 1, 2, B, W), _NEG_INF, dtype=arcs.dtype, device=arcs.device)
    # Views made once: creating them inside the loop would cost as much as the ops.
    alpha_rows, cells = alpha.unbind(0), alpha[:, :, 1 : S + 2].unbind(0)
    term_rows, arc_rows = terms.unbind(0), arcs.unbind(0)
    from_x, from_y = terms[:, 0, :, 0 : S + 1].unbind(0), terms[:, 1, :, 1 : S + 2].unbind(0)
    for d in range(d_first, d_last + 1):
        if d > d_first:
            torch.logaddexp(from_x[d - 1], from_y[d - 1], out=cells[d])
        if d in starts:
            bs, cols = starts[d]
            alpha[d, bs, cols] = 0.0
        if d < d_last:
            torch.add(alpha_rows[d], arc_rows[d], out=term_rows[d])
    return alpha, terms


def _arc_weights(
    alpha: Tensor, terms: Tensor, starts: Dict[int, Tuple[List[int], List[int]]], d_first: int
) -> Tensor:
    """Local arc weights: the share of each cell's score that came in by each of its two arcs.

    ``w_x = exp(alpha[d-1, c-1] + px - alpha[d, c])`` and ``w_y = 1 - w_x``,
    as in k2's backward: both are computed from the very numbers the forward
    step combined, so they sum to one however large the scores are.  Cells
    with a non-finite score, begin cells and non-finite ``w_x`` get zero
    weights.

    Args:
      alpha: ``(d_last+1, B, S+3)``; terms: ``(d_last+1, 2, B, S+3)`` (see :func:`_forward`).
      starts: step -> (batch indices, columns) of the begin cells.
      d_first: first step.
    Returns:
      ``(d_last+1, 2, B, S+3)``: ``[d, 0, b, c]`` weight of the px arc into
      cell ``(d, c)``, ``[d, 1, b, c]`` of the py arc; zero in the padding.
    """
    D1, _, B, W = terms.shape
    S = W - 3
    weights = torch.zeros_like(terms)
    if D1 - 1 > d_first:
        total = alpha[d_first + 1 :, :, 1 : S + 2]
        w_x = (terms[d_first:-1, 0, :, 0 : S + 1] - total).exp()
        ok = torch.isfinite(total) & torch.isfinite(w_x)
        zero = torch.zeros((), dtype=w_x.dtype, device=w_x.device)
        weights[d_first + 1 :, 0, :, 1 : S + 2] = torch.where(ok, w_x, zero)
        weights[d_first + 1 :, 1, :, 1 : S + 2] = torch.where(ok, 1.0 - w_x, zero)
    for d, (bs, cols) in starts.items():
        weights[d, :, bs, cols] = 0.0
    return weights


def _backward(
    weights: Tensor, ends: Dict[int, Tuple[List[int], List[int]]], d_first: int, num_rows: int
) -> Tensor:
    """The backward recursion in probability space: two tensor ops per step.

    The occupancy ``g`` of the end cell is 1; a cell passes its occupancy to
    its two predecessors in proportion to the arc weights, so ``g`` stays in
    ``[0, 1]`` and what leaves a cell is what came in.

    Args:
      weights: ``(d_last+1, 2, B, S+3)`` from :func:`_arc_weights`.
      ends: step -> (batch indices, columns) of the end cells.
      d_first: first step.
      num_rows: rows of the result (``>= d_last + 1``).
    Returns:
      ``(num_rows, 2, B, S+3)``: ``[d, 0, b, c]`` the occupancy of the px arc
      into cell ``(d, c)``, ``[d, 1, b, c]`` of the py arc (zero elsewhere).
    """
    D1, _, B, W = weights.shape
    S = W - 3
    d_last = D1 - 1
    occ = torch.zeros((D1, B, W), dtype=weights.dtype, device=weights.device)  # cell occupancy g
    arc_occ = torch.zeros((num_rows, 2, B, W), dtype=weights.dtype, device=weights.device)
    occ_rows, occ_cells = occ.unbind(0), occ[:, :, 1 : S + 2].unbind(0)
    weight_rows, arc_rows = weights.unbind(0), arc_occ[:D1].unbind(0)
    via_x, via_y = arc_occ[:D1, 0, :, 2 : S + 3].unbind(0), arc_occ[:D1, 1, :, 1 : S + 2].unbind(0)
    if d_last in ends:
        bs, cols = ends[d_last]
        occ[d_last, bs, cols] = 1.0
    for d in range(d_last, d_first, -1):
        torch.mul(occ_rows[d], weight_rows[d], out=arc_rows[d])
        # cell (d-1, c) left by its px arc into (d, c+1) and its py arc into (d, c)
        torch.add(via_x[d], via_y[d], out=occ_cells[d - 1])
        if d - 1 in ends:
            bs, cols = ends[d - 1]
            occ[d - 1, bs, cols] = 1.0
    return arc_occ


def _mutual_information(
    px: Tensor, py: Tensor, boundary: Tensor, with_grad: bool
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Forward (and optionally backward) lattice recursion, no autograd.

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified); py: ``(B, S+1, T)``;
      boundary: ``(B, 4)`` int64.
      with_grad: also compute the occupancy posteriors.
    Returns:
      ``scores`` ``(B,)`` = ``p[b, s_end, t_end]``, and if ``with_grad``
      ``px_grad`` (shape of ``px``) = d score / d px and ``py_grad``
      ``(B, S+1, T)`` = d score / d py (else None, None).  Sequences with
      score ``-inf`` get all-zero posteriors.
    """
    B, S, T1 = px.shape
    T = py.shape[2]
    modified = T1 == T
    rows = _check_boundary(boundary, B, S, T)
    D = _num_steps(S, T, modified)
    device = px.device

    # float64 throughout, whatever the input dtype: see _WORK_DTYPE.
    arcs = torch.full((D, 2, B, S + 3), _NEG_INF, dtype=_WORK_DTYPE, device=device)
    _to_steps(px, arcs[:, 0], modified)  # column S+1 stays -inf: there is no px row S
    _to_steps(py, arcs[:, 1], modified)
    starts = _group_by_step(rows, 0, 1, modified)
    ends = _group_by_step(rows, 2, 3, modified)
    d_first = min(starts) if starts else 0
    d_last = max(ends) if ends else 0  # no cell beyond this step matters

    alpha, terms = _forward(arcs, starts, d_first, d_last)
    end_step = boundary[:, 3] if modified else boundary[:, 2] + boundary[:, 3]
    scores = alpha[end_step, torch.arange(B, device=device), boundary[:, 2] + 1].to(px.dtype)  # (B,)
    if not with_grad:
        return scores, None, None

    arc_occ = _backward(_arc_weights(alpha, terms, starts, d_first), ends, d_first, D + 1)
    px_grad = _from_steps(arc_occ[:, 0], S, T1, modified, step_offset=1, col_offset=2).to(px.dtype)
    py_grad = _from_steps(arc_occ[:, 1], S + 1, T, modified, step_offset=1, col_offset=1).to(px.dtype)
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

    The forward recursion runs one step at a time (an anti-diagonal ``s + t``,
    or a frame for the modified lattice), two batched tensor ops per step.
    The gradient is k2's: each cell's occupancy is split between its two
    incoming arcs in the proportion the forward step combined them, from the
    end cell back (two ops per step), so float32 posteriors are as accurate
    as k2's and sum to the path length.  Memory is ``O(B * S * (S + T))``.

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified),
        float32/float64, symbol-arc log-scores.  For regular RNN-T
        ``px[:, :, T]`` (and ``px[b, :, t_end_b]``) should be ``-inf``.
      py: ``(B, S+1, T)`` same dtype/device, frame-arc log-scores.
      boundary: ``(B, 4)`` int64 ``[s_begin, t_begin, s_end, t_end]`` with
        ``0 <= s_begin <= s_end <= S`` and ``0 <= t_begin <= t_end <= T``;
        None means ``[0, 0, S, T]``.
      return_grad: also return ``(px_grad, py_grad)``, shapes of ``px``/``py``:
        ``d scores[b] / d px[b]`` and ``d scores[b] / d py[b]``, i.e. the
        posterior occupancy of every arc (zero for arcs outside the boundary
        and for sequences whose score is ``-inf``).  These are detached.

    Returns:
      ``scores`` ``(B,)`` = ``p[b, s_end, t_end]``, or
      ``(scores, (px_grad, py_grad))`` if ``return_grad``.  ``scores`` is
      differentiable w.r.t. ``px`` and ``py``.
    """
    B, S, T = _check_px_py(px, py)
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
