"""The ``(B, 4)`` boundary of k2's lattices and its helpers, in pure PyTorch (part of
:mod:`icefall_lite.nn.rnnt_loss`, which states the lattice conventions): each row ``[s_begin, t_begin, s_end,
t_end]`` of a sequence, :func:`make_boundary` from lengths, :func:`fix_for_boundary` for the modified
lattice's ``px``."""

from __future__ import annotations

from typing import List, Optional

import torch

Tensor = torch.Tensor

NEG_INF = float("-inf")


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


def default_boundary(B: int, S: int, T: int, device: torch.device) -> Tensor:
    """``(B, 4)`` int64 rows ``[0, 0, S, T]``."""
    boundary = torch.zeros((B, 4), dtype=torch.int64, device=device)
    boundary[:, 2] = S
    boundary[:, 3] = T
    return boundary


def check_boundary(boundary: Tensor, B: int, S: int, T: int) -> List[List[int]]:
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
    return px.scatter(2, t_end, NEG_INF)
