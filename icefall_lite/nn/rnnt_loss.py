"""Pure-PyTorch RNN-T losses, named as k2 names them.

k2 (``k2/python/k2/rnnt_loss.py``, ``mutual_information.py``) is not
installable next to a modern torch, so this module re-implements the parts an
icefall pruned-transducer recipe uses, with the same names and argument
orders, so a reader who knows k2 finds their way and a k2 backend can be
swapped in:

- :func:`mutual_information_recursion`: the lattice recursion every loss
  reduces to, as a ``torch.autograd.Function`` with an analytic backward
  (forward/backward scores -> occupancy posteriors).
- :func:`rnnt_loss_simple`, :func:`rnnt_loss_smoothed`: the "trivial joiner"
  losses (joint = lm + am) used to find pruning bounds.
- :func:`get_rnnt_prune_ranges`, :func:`do_rnnt_pruning`,
  :func:`rnnt_loss_pruned`: the pruned loss of arXiv 2206.13236.
- :func:`rnnt_loss`: the ordinary RNN-T loss on full ``(B, T, U+1, V)``
  logits, with torchaudio's argument order.

The lattice recursion and the ``boundary`` helpers live in
:mod:`icefall_lite.nn.mutual_information`, the ``px``/``py`` scores of the
joiners in :mod:`icefall_lite.nn.rnnt_logprobs`; this module holds the losses
and re-exports every public name.

Only the standard ("regular") RNN-T topology is implemented: a real symbol
keeps the frame, the termination/blank symbol advances it.

Conventions
-----------
Lattice: ``p[b, s, t]`` is the log-score of having emitted ``s`` symbols and
consumed ``t`` frames; ``px[b, s, t]`` scores ``(s, t) -> (s+1, t)`` (emit
symbol ``s``), ``py[b, s, t]`` scores ``(s, t) -> (s, t+1)`` (emit blank).

``boundary`` is an int64 tensor ``(B, 4)`` with rows
``[s_begin, t_begin, s_end, t_end]``; for transducer training it is
``[0, 0, U_b, T_b]`` (number of target symbols, number of frames), see
:func:`make_boundary`.  ``None`` means ``[0, 0, S, T]`` for every sequence.

Reductions (as k2 and torchaudio): ``"none"`` returns the ``(B,)`` losses,
``"sum"`` their sum, ``"mean"`` their mean over the batch (``sum / B``; not
divided by lengths).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from icefall_lite.nn.mutual_information import make_boundary, mutual_information_recursion
from icefall_lite.nn.rnnt_logprobs import (
    get_rnnt_logprobs,
    get_rnnt_logprobs_joint,
    get_rnnt_logprobs_pruned,
    get_rnnt_logprobs_smoothed,
)

Tensor = torch.Tensor

__all__ = [
    "make_boundary",
    "mutual_information_recursion",
    "get_rnnt_logprobs",
    "get_rnnt_logprobs_smoothed",
    "get_rnnt_logprobs_joint",
    "get_rnnt_logprobs_pruned",
    "rnnt_loss_simple",
    "rnnt_loss_smoothed",
    "get_rnnt_prune_ranges",
    "do_rnnt_pruning",
    "rnnt_loss_pruned",
    "rnnt_loss",
]


def _reduce(loss: Tensor, reduction: Optional[str]) -> Tensor:
    """Apply ``"none"`` | ``"mean"`` (over batch) | ``"sum"`` to ``(B,)`` losses."""
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"reduction should be 'none', 'mean' or 'sum', given {reduction!r}")


def _lattice_loss(
    px: Tensor, py: Tensor, boundary: Optional[Tensor], reduction: Optional[str], return_grad: bool = False
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """The reduced ``-log`` total score of the lattice ``px`` ``(B, S, T+1)``, ``py`` ``(B, S+1, T)``.

    With ``return_grad``: ``(loss, (px_grad, py_grad))``, the occupancy posteriors.
    """
    out = mutual_information_recursion(px, py, boundary, return_grad)
    if return_grad:
        scores, grads = out  # type: ignore[misc]
        return _reduce(-scores, reduction), grads
    return _reduce(-out, reduction)  # type: ignore[operator]


# --------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------


def rnnt_loss_simple(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
    reduction: Optional[str] = "mean",
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """RNN-T loss with the trivial joiner ``logits = lm[b, s] + am[b, t]``.

    Args:
      lm: ``(B, S+1, C)``; am: ``(B, T, C)``; symbols: ``(B, S)`` int64;
      termination_symbol: blank id; boundary: ``(B, 4)`` or None;
      reduction: ``"none"`` | ``"mean"`` (over batch) | ``"sum"``;
      return_grad: also return the occupancy posteriors for pruning.
    Returns:
      loss (``(B,)`` or scalar) = ``-log P(symbols | am, lm)``, or
      ``(loss, (px_grad (B, S, T+1), py_grad (B, S+1, T)))``.
    """
    px, py = get_rnnt_logprobs(lm, am, symbols, termination_symbol, boundary)
    return _lattice_loss(px, py, boundary, reduction, return_grad)


def rnnt_loss_smoothed(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    lm_only_scale: float = 0.1,
    am_only_scale: float = 0.1,
    boundary: Optional[Tensor] = None,
    reduction: Optional[str] = "mean",
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """Simple RNN-T loss with LM-only / AM-only smoothing (see
    :func:`get_rnnt_logprobs_smoothed`).  With both scales 0 it equals
    :func:`rnnt_loss_simple`.

    Args/Returns: as :func:`rnnt_loss_simple`, plus the two scales.
    """
    px, py = get_rnnt_logprobs_smoothed(lm, am, symbols, termination_symbol, lm_only_scale, am_only_scale, boundary)
    return _lattice_loss(px, py, boundary, reduction, return_grad)


def _monotonic_lower_bound(x: Tensor) -> Tensor:
    """``out[b, i] = min_{j >= i} x[b, j]`` for ``x`` ``(B, T)``."""
    return torch.flip(torch.cummin(torch.flip(x, dims=[1]), dim=1).values, dims=[1])


def _adjust_pruning_lower_bound(s_begin: Tensor, s_range: int) -> Tensor:
    """Make window starts ``(B, T)`` usable: non-decreasing, ``s_begin[:, 0] = 0``,
    and ``s_begin[t+1] - s_begin[t] <= s_range - 1`` (no symbol skipped).

    Each constraint only ever lowers entries, so a later frame's start (in
    particular the forced last-frame value) is never raised.
    """
    B, T = s_begin.shape
    s_begin = _monotonic_lower_bound(s_begin)
    # s[t+1] - s[t] <= R-1  <=>  t*(R-1) - s[t] non-decreasing
    ramp = (s_range - 1) * torch.arange(T, device=s_begin.device, dtype=s_begin.dtype)
    shifted = _monotonic_lower_bound(ramp - s_begin).clamp(min=0)  # clamp: s[t] <= t*(R-1)
    return ramp - shifted


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
    non-decreasing, start at 0 and advance by at most ``R - 1`` per frame.

    ``R`` is capped at ``S + 1`` and raised, if needed, to
    ``max_b ceil(U_b / T_b) + 1`` so that some path survives pruning.

    Args:
      px_grad: ``(B, S, T+1)``; py_grad: ``(B, S+1, T)`` (from
        ``rnnt_loss_simple(..., return_grad=True)``).
      boundary: ``(B, 4)`` int64 ``[0, 0, U_b, T_b]``.
      s_range: requested window size ``R >= 2``.
    Returns:
      ``ranges`` ``(B, T, R')`` int64, ``ranges[b, t] = s0[b, t] + arange(R')``,
      all entries in ``[0, S]``.
    """
    if px_grad.ndim != 3 or py_grad.ndim != 3:
        raise ValueError("px_grad and py_grad must be 3-D")
    B, S, T1 = px_grad.shape
    T = T1 - 1
    if py_grad.shape != (B, S + 1, T):
        raise ValueError(f"py_grad must be (B, S+1, T) = {(B, S + 1, T)}, got {tuple(py_grad.shape)}")
    if boundary is None or boundary.shape != (B, 4):
        raise ValueError(f"boundary must be a (B, 4) = ({B}, 4) int64 tensor")
    if s_range < 2 and S > 0:
        raise ValueError(f"s_range must be >= 2 for the standard RNN-T, got {s_range}")
    device = px_grad.device
    boundary = boundary.to(device=device, dtype=torch.int64)

    U_b, T_b = boundary[:, 2], boundary[:, 3]
    needed = int(((U_b + T_b.clamp(min=1) - 1) // T_b.clamp(min=1)).max().item()) + 1 if B > 0 else 1
    s_range = min(max(s_range, needed), S + 1)

    # window mass: (B, S+2-R, T)
    blk = py_grad.unfold(1, s_range, 1).sum(dim=3)
    px_pad = torch.cat([torch.zeros((B, 1, T1), dtype=px_grad.dtype, device=device), px_grad], dim=1)
    score = blk - px_pad[:, : S + 2 - s_range, :T]
    s_begin = score.argmax(dim=1)  # (B, T)

    t_idx = torch.arange(T, device=device).unsqueeze(0)
    last = (U_b - s_range + 1).clamp(min=0).unsqueeze(1)  # (B, 1)
    s_begin = torch.where(t_idx < (T_b - 1).unsqueeze(1), s_begin, last)
    s_begin = _adjust_pruning_lower_bound(s_begin, s_range)
    return s_begin.unsqueeze(2) + torch.arange(s_range, device=device)


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


def rnnt_loss_pruned(
    logits: Tensor,
    symbols: Tensor,
    ranges: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
    reduction: Optional[str] = "mean",
) -> Tensor:
    """RNN-T loss over the pruned lattice (arcs outside the windows removed).

    Args:
      logits: ``(B, T, R, C)`` joiner output on the windows
        (from :func:`do_rnnt_pruning` + joiner).
      symbols: ``(B, S)`` int64; ranges: ``(B, T, R)`` int64;
      termination_symbol: blank id; boundary: ``(B, 4)`` or None;
      reduction: ``"none"`` | ``"mean"`` (over batch) | ``"sum"``.
    Returns:
      ``(B,)`` losses or a scalar.  Equals the full loss when ``R = S + 1``.
    """
    px, py = get_rnnt_logprobs_pruned(logits, symbols, ranges, termination_symbol, boundary)
    return _lattice_loss(px, py, boundary, reduction)  # type: ignore[return-value]


def rnnt_loss(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = 0,
    reduction: str = "mean",
) -> Tensor:
    """Full RNN-T loss, torchaudio argument order.

    Args:
      logits: ``(B, T, U+1, V)`` unnormalised joiner output (float32/64).
      targets: ``(B, U)`` integer; entries at ``u >= target_lengths[b]`` are
        ignored (any value, e.g. padding -1).
      logit_lengths: ``(B,)`` frames ``T_b <= T``.
      target_lengths: ``(B,)`` symbols ``U_b <= U``.
      blank: blank id.
      reduction: ``"none"`` -> ``(B,)``, ``"sum"``, or ``"mean"`` = mean over
        the batch.
    Returns:
      ``-log P(targets | logits)`` per sequence, reduced.
    """
    if logits.ndim != 4:
        raise ValueError(f"logits must be (B, T, U+1, V), got {tuple(logits.shape)}")
    B, T, U1, V = logits.shape
    U = U1 - 1
    if targets.shape != (B, U):
        raise ValueError(
            f"targets must be (B, U) = {(B, U)} for logits {tuple(logits.shape)}, got {tuple(targets.shape)}"
        )
    if logit_lengths.shape != (B,) or target_lengths.shape != (B,):
        raise ValueError("logit_lengths and target_lengths must be (B,)")
    device = logits.device
    boundary = make_boundary(target_lengths.to(device), logit_lengths.to(device))
    targets = targets.to(device=device, dtype=torch.int64)
    valid = torch.arange(U, device=device).unsqueeze(0) < boundary[:, 2:3]
    symbols = torch.where(valid, targets, torch.full_like(targets, blank))
    px, py = get_rnnt_logprobs_joint(logits, symbols, blank, boundary)
    return _lattice_loss(px, py, boundary, reduction)  # type: ignore[return-value]
