"""The pruned loss's windows, with k2's API (arXiv 2206.13236, section 3.2): which ``R`` symbols of each
frame the pruned joiner scores (:func:`get_rnnt_prune_ranges`, k2's earlier
:func:`get_rnnt_prune_ranges_deprecated`), k2's raise of ``R`` where a sequence has too many symbols for its
frames (:func:`raised_s_range`, which the training step computes from the lengths the host has:
:func:`get_rnnt_prune_ranges_raised`), and the gathering of the encoder and decoder outputs at those
windows (:func:`do_rnnt_pruning`). :mod:`icefall_lite.nn.rnnt_loss` re-exports k2's names; its docstring has
the lattice's conventions."""

from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def _monotonic_lower_bound(x: Tensor) -> Tensor:
    """``out[b, i] = min_{j >= i} x[b, j]`` for ``x`` ``(B, T)``."""
    return torch.flip(torch.cummin(torch.flip(x, dims=[1]), dim=1).values, dims=[1])


def _adjust_pruning_lower_bound(s_begin: Tensor, max_step: int) -> Tensor:
    """Make window starts ``(B, T)`` usable: non-decreasing, ``s_begin[:, 0] = 0``,
    and ``s_begin[t+1] - s_begin[t] <= max_step`` (no symbol skipped).

    Each constraint only ever lowers entries, so a later frame's start (in
    particular the forced last-frame value) is never raised.

    Args:
      s_begin: ``(B, T)`` int64 proposed starts.
      max_step: ``s_range - 1`` for the regular lattice, 1 for the modified
        ones (one symbol per frame).
    """
    B, T = s_begin.shape
    s_begin = _monotonic_lower_bound(s_begin)
    # s[t+1] - s[t] <= m  <=>  t*m - s[t] non-decreasing
    ramp = max_step * torch.arange(T, device=s_begin.device, dtype=s_begin.dtype)
    shifted = _monotonic_lower_bound(ramp - s_begin).clamp(min=0)  # clamp: s[t] <= t*m
    return ramp - shifted


def raised_s_range(token_lens: Tensor, frame_lens: Tensor, s_range: int) -> int:
    """k2's raise of a regular lattice's window: ``max(s_range, max_b (U_b - 1) // T_b + 2)`` (truncating
    division, ``T_b`` at least 1), so that ``(R - 1) * T_b >= U_b`` and some path survives pruning.

    A max over the batch: a host read when the lengths are on a device. The training step computes it from
    the lengths the host already has (:func:`icefall_lite.train.loss.loss_inputs`) and passes
    it to :func:`get_rnnt_prune_ranges_raised`.

    Args:
      token_lens: (B,) int, ``U_b``; frame_lens: (B,) int, ``T_b`` (the lattice's frames: the encoder's).
    """
    if token_lens.numel() == 0:
        return s_range
    needed = torch.div(token_lens - 1, frame_lens.clamp(min=1), rounding_mode="trunc") + 2
    return max(s_range, int(needed.max().item()))


def _prune_range_size(boundary: Tensor, S: int, s_range: int, regular: bool, raised: bool) -> int:
    """The window size k2 uses for a requested ``s_range``.

    Regular lattices need ``(s_range - 1) * T_b >= U_b`` for some path to
    survive: ``s_range`` is raised (:func:`raised_s_range`) unless ``raised`` says the caller did; then it
    is capped at ``S + 1``.

    Returns:
      The window size ``R``; raises ValueError if it is below 2 (regular,
      ``S > 0``) or 1 (modified).
    """
    if regular and not raised:
        s_range = raised_s_range(boundary[:, 2], boundary[:, 3], s_range)
    s_range = min(s_range, S + 1)
    if regular and s_range < 2 and S > 0:
        raise ValueError(f"s_range must be >= 2 for the regular RNN-T, got {s_range}")
    if not regular and s_range < 1:
        raise ValueError(f"s_range must be >= 1 for the modified RNN-T, got {s_range}")
    return s_range


def _check_grads_boundary(px_grad: Tensor, py_grad: Tensor, boundary: Tensor) -> Tuple[int, int, int, bool]:
    """Validate occupancy posteriors and boundary; returns ``(B, S, T, regular)``."""
    if px_grad.ndim != 3 or py_grad.ndim != 3:
        raise ValueError("px_grad and py_grad must be 3-D")
    B, S, T1 = px_grad.shape
    T = py_grad.shape[2]
    if py_grad.shape != (B, S + 1, T) or T1 not in (T, T + 1):
        raise ValueError(
            f"py_grad must be (B, S+1, T) and px_grad (B, S, T+1) or (B, S, T); "
            f"got {tuple(px_grad.shape)}, {tuple(py_grad.shape)}"
        )
    if boundary is None or boundary.shape != (B, 4):
        raise ValueError(f"boundary must be a (B, 4) = ({B}, 4) int64 tensor")
    return B, S, T, T1 == T + 1


def _finish_prune_ranges(s_begin: Tensor, boundary: Tensor, s_range: int, regular: bool) -> Tensor:
    """Force the last frames' windows to end at ``U_b``, adjust, and expand to ranges.

    Args:
      s_begin: ``(B, T)`` proposed starts; boundary: ``(B, 4)``.
    Returns:
      ``(B, T, s_range)`` int64.
    """
    T = s_begin.shape[1]
    device = s_begin.device
    U_b, T_b = boundary[:, 2], boundary[:, 3]
    t_idx = torch.arange(T, device=device).unsqueeze(0)
    last = (U_b - s_range + 1).clamp(min=0).unsqueeze(1)  # (B, 1)
    s_begin = torch.where(t_idx < (T_b - 1).unsqueeze(1), s_begin, last)
    s_begin = _adjust_pruning_lower_bound(s_begin, s_range - 1 if regular else 1)
    return s_begin.unsqueeze(2) + torch.arange(s_range, device=device)


def get_rnnt_prune_ranges(
    px_grad: Tensor,
    py_grad: Tensor,
    boundary: Tensor,
    s_range: int,
) -> Tensor:
    """Pruning windows from the simple loss's occupancy posteriors (k2;
    arXiv 2206.13236, section 3.2).

    For each frame ``t`` the window start ``s0`` maximises the probability
    mass of leaving frame ``t`` from inside ``[s0, s0 + R)``:
    ``sum_{k<R} py_grad[s0+k, t] - px_grad[s0-1, t]`` (``px_grad[-1] = 0``).
    Then, per sequence: frames ``t >= T_b - 1`` get ``max(U_b - R + 1, 0)``
    (so the last real frame's window ends at ``U_b``), and the starts are made
    non-decreasing, start at 0 and advance by at most ``R - 1`` per frame
    (1 for the modified lattices, which emit at most one symbol per frame).

    ``R`` is raised, for the regular lattice, to ``max_b (U_b - 1) // T_b + 2``
    so that some path survives pruning, then capped at ``S + 1`` (as k2, which
    also prints a warning for either change; this function does not).

    Args:
      px_grad: ``(B, S, T+1)`` (regular) or ``(B, S, T)`` (modified,
        constrained); py_grad: ``(B, S+1, T)`` (from
        ``rnnt_loss_simple(..., return_grad=True)``).
      boundary: ``(B, 4)`` int64 ``[0, 0, U_b, T_b]``.
      s_range: requested window size ``R`` (>= 2 regular, >= 1 modified).
    Returns:
      ``ranges`` ``(B, T, R')`` int64, ``ranges[b, t] = s0[b, t] + arange(R')``,
      all entries in ``[0, S]``.
    """
    return _prune_ranges(px_grad, py_grad, boundary, s_range, raised=False)


def get_rnnt_prune_ranges_raised(px_grad: Tensor, py_grad: Tensor, boundary: Tensor, s_range: int) -> Tensor:
    """:func:`get_rnnt_prune_ranges` for an ``s_range`` that is :func:`raised_s_range` of these lengths
    already (computed where the lengths are on the host): the same windows, without the raise's read of the
    boundary."""
    return _prune_ranges(px_grad, py_grad, boundary, s_range, raised=True)


def _prune_ranges(px_grad: Tensor, py_grad: Tensor, boundary: Tensor, s_range: int, raised: bool) -> Tensor:
    B, S, T, regular = _check_grads_boundary(px_grad, py_grad, boundary)
    device = px_grad.device
    boundary = boundary.to(device=device, dtype=torch.int64)
    s_range = _prune_range_size(boundary, S, s_range, regular, raised)

    # window mass: (B, S+2-R, T)
    blk = py_grad.unfold(1, s_range, 1).sum(dim=3)
    px_pad = torch.cat([torch.zeros((B, 1, px_grad.shape[2]), dtype=px_grad.dtype, device=device), px_grad], dim=1)
    score = blk - px_pad[:, : S + 2 - s_range, :T]
    return _finish_prune_ranges(score.argmax(dim=1), boundary, s_range, regular)


def get_rnnt_prune_ranges_deprecated(
    px_grad: Tensor,
    py_grad: Tensor,
    boundary: Tensor,
    s_range: int,
) -> Tensor:
    """k2's earlier pruning windows, kept in k2 for comparison (its tests call it).

    The window start ``s0`` of frame ``t`` maximises the total occupancy of
    rows ``[s0, s0 + R)`` of column ``t``: ``sum_k (px_grad + py_grad)[s0+k, t]``
    (``px_grad`` row ``S`` and ``py_grad`` column ``T`` taken as 0), without
    the correction for symbol arcs entering the window that
    :func:`get_rnnt_prune_ranges` applies; the last-frame rule and the
    adjustments are the same.  ``R`` is only capped at ``S + 1``.

    Args/Returns: as :func:`get_rnnt_prune_ranges`.
    """
    B, S, T, regular = _check_grads_boundary(px_grad, py_grad, boundary)
    device = px_grad.device
    boundary = boundary.to(device=device, dtype=torch.int64)
    s_range = min(s_range, S + 1)
    if s_range < (2 if regular and S > 0 else 1):
        raise ValueError(f"s_range {s_range} too small for the {'regular' if regular else 'modified'} RNN-T")
    occupancy = py_grad.clone()  # (B, S+1, T)
    occupancy[:, :S] += px_grad[:, :, :T]
    score = occupancy.unfold(1, s_range, 1).sum(dim=3)  # (B, S+2-R, T)
    return _finish_prune_ranges(score.argmax(dim=1), boundary, s_range, regular)


def do_rnnt_pruning(am: Tensor, lm: Tensor, ranges: Tensor) -> Tuple[Tensor, Tensor]:
    """Expand encoder and gather decoder outputs onto the pruning windows.

    Args:
      am: ``(B, T, D_am)`` encoder output (after the joiner's projection).
      lm: ``(B, S+1, D_lm)`` decoder output (after the joiner's projection).
      ranges: ``(B, T, R)`` int64 in ``[0, S]``.
    Returns:
      ``am_pruned`` ``(B, T, R, D_am)`` (an expanded view) and ``lm_pruned``
      ``(B, T, R, D_lm)`` with ``lm_pruned[b, t, r] = lm[b, ranges[b, t, r]]``.
    """
    if ranges.ndim != 3 or ranges.shape[0] != am.shape[0] or ranges.shape[1] != am.shape[1]:
        raise ValueError(f"ranges must be (B, T, s_range) matching am {tuple(am.shape)}, got {tuple(ranges.shape)}")
    if lm.shape[0] != am.shape[0]:
        raise ValueError("am and lm must have the same batch size")
    B, T, R = ranges.shape
    D_am, D_lm = am.shape[2], lm.shape[2]
    am_pruned = am.unsqueeze(2).expand(B, T, R, D_am)
    idx = ranges.to(torch.int64).reshape(B, T * R, 1).expand(B, T * R, D_lm)
    lm_pruned = torch.gather(lm, 1, idx).reshape(B, T, R, D_lm)
    return am_pruned, lm_pruned
