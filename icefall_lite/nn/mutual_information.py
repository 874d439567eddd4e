"""The lattice recursions of k2's ``mutual_information.py`` and the ``boundary`` helpers, in pure PyTorch.

Part of :mod:`icefall_lite.nn.rnnt_loss` (which re-exports the public names and
states the lattice conventions): :func:`make_boundary` builds the ``(B, 4)``
boundary from lengths (:mod:`icefall_lite.nn.boundary`, re-exported here as k2's
module has it); :func:`mutual_information_recursion` is the recursion
every RNN-T loss reduces to (k2's arguments, shapes and results, for the
regular and the modified lattice), with an analytic backward computed in
float64 whatever the input dtype, on CUDA by the Triton kernel of
:mod:`icefall_lite.nn.mutual_information_triton` (``BACKEND``);
:func:`joint_mutual_information_recursion`
splits the total score into the contributions of several ``px``/``py`` terms.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from icefall_lite.nn.boundary import NEG_INF, check_boundary, default_boundary, fix_for_boundary, make_boundary

Tensor = torch.Tensor

__all__ = ["make_boundary", "fix_for_boundary", "mutual_information_recursion", "joint_mutual_information_recursion"]


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
# imports, and this module's PyTorch recursion (the CPU path, and the kernel's
# oracle) otherwise; "pytorch" or "triton" forces one (tests and benchmarks set
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
