"""k2's mutual-information recursion in pure PyTorch: the CPU path of
:func:`icefall_lite.nn.mutual_information.mutual_information_recursion` and the oracle of its Triton kernel
(:mod:`icefall_lite.nn.mutual_information_triton`). :func:`_mutual_information` returns the scores and the arcs'
posteriors in one pass over the lattice's steps; the autograd wrapper and the dispatch are
:mod:`icefall_lite.nn.mutual_information`'s.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from icefall_lite.nn.boundary import NEG_INF, check_boundary

Tensor = torch.Tensor


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


# The dtype the recursions run in, whatever the input dtype.  The scores of a
# long lattice are large (|p| ~ 1000 for an utterance), and float32 rounding
# of them (~3e-5 at 500) would show in every arc weight; float64 makes the
# float32 posteriors as accurate as float32 can hold them.  The per-step
# tensors are only (2, B, S+3): float64 costs no measurable time.
_WORK_DTYPE = torch.float64


def _step_of(s: int, t: int, modified: bool) -> int:
    """Step index of cell ``(s, t)``."""
    return t if modified else s + t


def _num_steps(S: int, T: int, modified: bool) -> int:
    """Number of steps ``D`` of an ``(S+1) x (T+1)`` lattice."""
    return T + 1 if modified else S + T + 1


def _cells_view(
    buf: Tensor, shape: Tuple[int, int, int], modified: bool, step_offset: int, k: int, col_offset: int
) -> Tensor:
    """A ``(B, R, W)`` view of a step-major buffer:
    ``[b, s, t] -> buf[step(s, t) + step_offset, k, b, s + col_offset]``.

    Args:
      buf: contiguous ``(D', K, B, C)``.
      shape: ``(B, R, W)``; every addressed element must lie in ``buf``.
      modified: which lattice; step_offset, k, col_offset: as in the formula.
    Returns:
      A strided view (no copy), so a layout change is one strided copy.
    """
    _, K, B, C = buf.shape
    row = K * B * C  # elements per step
    stride_s = 1 if modified else row + 1
    return buf.as_strided(shape, (C, stride_s, row), buf.storage_offset() + step_offset * row + k * B * C + col_offset)


def _group_by_step(
    rows: List[List[int]], s_col: int, t_col: int, modified: bool
) -> Dict[int, Tuple[List[int], List[int]]]:
    """Map step -> (batch indices, step-major columns ``s+1``) of one corner of every boundary row."""
    groups: Dict[int, Tuple[List[int], List[int]]] = {}
    for b, row in enumerate(rows):
        s, t = row[s_col], row[t_col]
        bs, cols = groups.setdefault(_step_of(s, t, modified), ([], []))
        bs.append(b)
        cols.append(s + 1)
    return groups


# The recursions' buffer is one flat storage: rows of K * B * (S+3) scores
# (K = 1: forward; K = 2: forward and backward), one per step, with one -inf
# element before the first row and after the last.  Every op of the loop then
# reads and writes contiguous memory: a step's two predecessor terms are the
# previous row read one element apart (the neighbours of a cell are the
# adjacent elements), and the padding columns 0 and S+2 of every (k, b) row
# compute to -inf because every arc into them is -inf.


def _neighbour_views(store: Tensor, rows: int, K: int, BW: int) -> List[Tensor]:
    """For every step ``i >= 1``, the two predecessor terms of every direction, as one strided view.

    The forward step (k = 0) needs the scores of columns ``c-1`` (px arc) and
    ``c`` (py arc) of the previous step; the backward step (k = 1), whose
    previous row holds the *next* step's scores, needs ``c`` (py arc) and
    ``c+1`` (px arc).  Term m of direction k is the previous row shifted by
    ``m + k - 1`` elements.

    Args:
      store: the flat buffer (see above); rows: number of steps; K: directions;
      BW: ``B * (S+3)``.
    Returns:
      ``rows - 1`` views ``(2, K, BW)``; view ``i - 1`` is
      ``[m, k, j] = row_{i-1}[k * BW + j + m + k - 1]``.
    """
    if rows < 2:
        return []
    size = (rows - 1, 2, K, BW)
    return list(store.as_strided(size, (K * BW, 1, BW + 1, 1), store.storage_offset()).unbind(0))


def _step_arcs(px: Tensor, py: Tensor, D: int, d_last: int, modified: bool, with_backward: bool) -> Tensor:
    """The arc scores the recursions add to :func:`_neighbour_views`, step-major, in the work dtype.

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified); py: ``(B, S+1, T)``.
      D: number of steps; d_last: the last step that matters; with_backward: also lay out the backward arcs.
    Returns:
      ``(D, 2, K, B*(S+3))``, row ``i - 1`` for step ``i`` (rows from
      ``d_last`` on unused): forward (k = 0) the px arc into each cell
      (leaving column ``c-1`` of step ``i - 1``, so px of cell ``(s, t)``
      sits in column ``s+2``) and the py arc (leaving column ``c = s+1``);
      backward (k = 1) the py and the px arc leaving each cell of step
      ``d_last - i`` (both in column ``s+1``); ``-inf`` where there is no arc.
    """
    B, S, _ = px.shape
    W = S + 3
    K = 2 if with_backward else 1
    out = torch.full((D, 2 * K, B, W), NEG_INF, dtype=_WORK_DTYPE, device=px.device)
    # _cells_view's "k" indexes dim 1 of (D, 2K, B, W): term m, direction k is m * K + k
    if px.numel() > 0:
        _cells_view(out, tuple(px.shape), modified, 0, 0, 2).copy_(px)
    if py.numel() > 0:
        _cells_view(out, tuple(py.shape), modified, 0, K, 1).copy_(py)
    rows = out.view(D, 2, K, B * W)
    if with_backward and d_last > 0:
        forward, backward = rows[:d_last, :, 0], rows[:d_last, :, 1]
        backward[:, 0] = forward[:, 1].flip(0)
        backward[:, 1, :-1] = forward[:, 0, 1:].flip(0)
    return rows


def _recursions(
    arc_rows: Tensor,
    B: int,
    starts: Dict[int, Tuple[List[int], List[int]]],
    ends: Dict[int, Tuple[List[int], List[int]]],
    d_first: int,
    d_last: int,
    with_backward: bool,
) -> Tensor:
    """Forward and (optionally) backward log-score recursions, run in the same steps.

    Step ``i`` computes the forward scores of step ``i`` and the backward
    scores of step ``d_last - i`` (independent of each other): one add of the
    predecessors' scores and the arcs for both directions, and one logaddexp,
    both on contiguous memory -- two tensor ops per step, whose views are all
    made before the loop.

    Args:
      arc_rows: ``(D, 2, K, B*(S+3))`` from :func:`_step_arcs`; B: batch size.
      starts, ends: step -> (batch indices, columns) of the begin / end cells.
      d_first, d_last: first and last step that matter.
      with_backward: also run the backward recursion.
    Returns:
      ``(D, K, B, S+3)``: ``[d, 0]`` the forward scores ``alpha`` of step
      ``d`` (``p`` of k2); with the backward, ``[i, 1]`` the backward scores of
      step ``d_last - i`` (log-sum over the paths from a cell to the end
      cell); ``-inf`` beyond ``d_last``.
    """
    D, _, K, BW = arc_rows.shape
    W = BW // B
    rows = D  # rows after d_last stay -inf
    store = torch.full((rows * K * BW + 2,), NEG_INF, dtype=arc_rows.dtype, device=arc_rows.device)
    buf = store[1:-1].view(rows, K, B, W)
    row_views = store[1:-1].view(rows, K * BW).unbind(0)
    neighbours = _neighbour_views(store, rows, K, BW)
    arc_steps = arc_rows[:d_last].unbind(0)
    scratch = torch.empty((2, K * BW), dtype=arc_rows.dtype, device=arc_rows.device)
    first_terms, second_terms, scratch_pairs = scratch[0], scratch[1], scratch.view(2, K, BW)
    # The backward direction starts at step d_last, so it runs over all of them.
    steps = range(0 if with_backward else d_first, d_last + 1)
    begins = _begin_cells(starts, ends if with_backward else {}, steps, d_last, BW, W, arc_rows.device)
    for i in steps:
        if i > 0:
            torch.add(neighbours[i - 1], arc_steps[i - 1], out=scratch_pairs)
            torch.logaddexp(first_terms, second_terms, out=row_views[i])
        if i in begins:
            row_views[i].index_fill_(0, begins[i], 0.0)
    return buf


def _begin_cells(
    starts: Dict[int, Tuple[List[int], List[int]]],
    ends: Dict[int, Tuple[List[int], List[int]]],
    steps: range,
    d_last: int,
    BW: int,
    W: int,
    device: torch.device,
) -> Dict[int, Tensor]:
    """Step -> the positions, in that step's row of :func:`_recursions`'s buffer, of the cells where a
    recursion begins (score 0): the begin cells of the forward direction (k = 0) at their own step, the end
    cells of the backward one (k = 1) at step ``d_last - step``. All of them go to the device in one copy
    (writing through Python lists inside the loop cost a host-to-device copy, and on a GPU a host
    synchronisation, per step)."""
    positions: Dict[int, List[int]] = {}
    for k, groups, step_of in ((0, starts, lambda d: d), (1, ends, lambda d: d_last - d)):
        for d, (bs, cols) in groups.items():
            i = step_of(d)
            if i in steps:
                positions.setdefault(i, []).extend(k * BW + b * W + c for b, c in zip(bs, cols))
    if not positions:
        return {}
    order = sorted(positions)
    flat = torch.tensor([p for i in order for p in positions[i]], dtype=torch.int64).to(device, non_blocking=True)
    out, offset = {}, 0
    for i in order:
        out[i] = flat[offset : offset + len(positions[i])]
        offset += len(positions[i])
    return out


def _lattice_view(z: Tensor, shape: Tuple[int, int, int], modified: bool, col_offset: int) -> Tensor:
    """A ``(B, R, W)`` view of a step-major ``z`` ``(D, B, C)`` (any strides):
    ``[b, s, t] -> z[step(s, t), b, s + col_offset]``; every addressed step must be ``< D``."""
    step_stride, b_stride, c_stride = z.stride()
    s_stride = c_stride if modified else c_stride + step_stride
    return z.as_strided(shape, (b_stride, s_stride, step_stride), z.storage_offset() + col_offset * c_stride)


def _flush_below(dtype: torch.dtype) -> float:
    """Occupancies at or below this are set to zero (``2**24`` times ``dtype``'s smallest normal number).

    They are ~1e-31 in float32, 24 orders of magnitude below what any sum of
    occupancies can resolve, and left in place they (and their products with
    the incoming gradient) are denormal numbers, on which a CPU's arithmetic
    runs many times slower: they made the backward of the pruned training
    loss 2x slower (issue 28).
    """
    return torch.finfo(dtype).tiny * 2.0**24


def _posteriors(
    buf: Tensor, d_last: int, px: Tensor, py: Tensor, scores: Tensor, modified: bool
) -> Tuple[Tensor, Tensor]:
    """Arc occupancies ``exp(alpha + arc + beta(next cell) - total)``.

    In float64 the forward and backward scores carry absolute errors of
    ~1e-13 even at |score| ~ 1000, so this is exact to float32 precision; the
    same formula in float32 has relative errors of ~1e-4 (issue 28).

    Args:
      buf: ``(D, 2, B, S+3)`` from :func:`_recursions`; d_last: last step.
      px, py: the arc scores (lattice layout); scores: ``(B,)`` totals (float64).
    Returns:
      ``px_grad``, ``py_grad`` in ``px``'s dtype; zero for sequences with score ``-inf`` and
      where below :func:`_flush_below`.
    """
    D, _, B, W = buf.shape
    total = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores)).reshape(1, B, 1)
    # row d: backward scores of step d + 1, less the total
    beta_next = torch.empty((D, B, W), dtype=buf.dtype, device=buf.device)
    beta_next[d_last:] = NEG_INF
    torch.sub(buf[:d_last, 1].flip(0), total, out=beta_next[:d_last])
    grads = []
    # the px arc leaving cell (s, t) enters column s+2 of the next step, the py arc column s+1
    for arc, next_col in ((px, 2), (py, 1)):
        if arc.numel() == 0:
            grads.append(torch.zeros_like(arc))
            continue
        shape = tuple(arc.shape)
        log_post = _lattice_view(buf[:, 0], shape, modified, 1) + arc
        log_post += _lattice_view(beta_next, shape, modified, next_col)
        post = torch.exp(log_post, out=torch.empty_like(arc))
        grads.append(torch.nn.functional.threshold_(post, _flush_below(arc.dtype), 0.0))
    return grads[0], grads[1]


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
      score ``-inf`` get all-zero posteriors.  A sequence with a NaN or
      ``+inf`` arc gets a NaN score and NaN posteriors, and the others are
      untouched: the recursion shares memory between neighbouring sequences
      (their padding columns meet), so such a sequence runs with ``-inf``
      arcs and is marked afterwards.
    """
    B, S, T1 = px.shape
    T = py.shape[2]
    modified = T1 == T
    rows = check_boundary(boundary, B, S, T)
    D = _num_steps(S, T, modified)
    device = px.device
    broken = _broken_sequences(px, py)  # (B,) bool, or None when no sequence is
    if broken is not None:
        px = px.masked_fill(broken.reshape(B, 1, 1), NEG_INF)
        py = py.masked_fill(broken.reshape(B, 1, 1), NEG_INF)

    starts = _group_by_step(rows, 0, 1, modified)
    ends = _group_by_step(rows, 2, 3, modified)
    d_first = min(starts) if starts else 0
    d_last = max(ends) if ends else 0  # no cell beyond this step matters
    arc_rows = _step_arcs(px, py, D, d_last, modified, with_grad)

    buf = _recursions(arc_rows, B, starts, ends, d_first, d_last, with_grad)
    end_step = boundary[:, 3] if modified else boundary[:, 2] + boundary[:, 3]
    scores = buf[end_step, 0, torch.arange(B, device=device), boundary[:, 2] + 1]  # (B,) float64
    if broken is not None:
        scores = scores.masked_fill(broken, float("nan"))
    if not with_grad:
        return scores.to(px.dtype), None, None
    px_grad, py_grad = _posteriors(buf, d_last, px, py, scores, modified)
    if broken is not None:
        nan = float("nan")
        px_grad = px_grad.masked_fill(broken.reshape(B, 1, 1), nan)
        py_grad = py_grad.masked_fill(broken.reshape(B, 1, 1), nan)
    return scores.to(px.dtype), px_grad, py_grad


def _broken_sequences(px: Tensor, py: Tensor) -> Optional[Tensor]:
    """``(B,)`` True where a sequence has a NaN or ``+inf`` arc score; None when none has.

    A NaN or ``+inf`` arc makes the sequence's float64 sum NaN or ``+inf``,
    while finite and ``-inf`` arcs cannot (float32 sums do not overflow in
    float64), so one reduction per tensor screens the batch; the exact
    element test runs only when a sum is suspect (float64 inputs near the
    top of their range can overflow it).
    """
    sums = px.sum(dim=(1, 2), dtype=torch.float64) + py.sum(dim=(1, 2), dtype=torch.float64)
    if bool((sums < float("inf")).all()):
        return None
    bad_px = (torch.isnan(px) | (px == float("inf"))).flatten(1).any(1)
    bad_py = (torch.isnan(py) | (py == float("inf"))).flatten(1).any(1)
    broken = bad_px | bad_py
    return broken if bool(broken.any()) else None
