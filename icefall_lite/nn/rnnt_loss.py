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

from typing import Dict, List, Optional, Tuple, Union

import torch

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


def _reduce(loss: Tensor, reduction: Optional[str]) -> Tensor:
    """Apply ``"none"`` | ``"mean"`` (over batch) | ``"sum"`` to ``(B,)`` losses."""
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"reduction should be 'none', 'mean' or 'sum', given {reduction!r}")


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


def _mutual_information(
    px: Tensor, py: Tensor, boundary: Tensor, with_grad: bool
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Forward (and optionally backward) lattice recursion, no autograd.

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

    # Per-diagonal views made once (unbind), and two scratch rows, so each
    # step of the loops below is three tensor ops and no Python-side indexing.
    px_from_s = PX[:, :, 0 : S + 1].unbind(0)  # arc (s-1, t) -> (s, t), on diagonal d-1
    py_from_t = PY[:, :, 1 : S + 2].unbind(0)  # arc (s, t-1) -> (s, t), on diagonal d-1
    scratch_a = torch.empty((B, S + 1), dtype=dtype, device=device)
    scratch_b = torch.empty((B, S + 1), dtype=dtype, device=device)

    # ---- forward scores: alpha[d, b, s+1] = p[b, s, d-s]
    alpha = torch.full((D, B, S + 3), _NEG_INF, dtype=dtype, device=device)
    alpha_shift = alpha[:, :, 0 : S + 1].unbind(0)  # p[s-1, .] in column s+1
    alpha_cells = alpha[:, :, 1 : S + 2].unbind(0)  # p[s, .] in column s+1
    for d in range(0, d_last + 1):
        if d > 0:
            torch.add(alpha_shift[d - 1], px_from_s[d - 1], out=scratch_a)
            torch.add(alpha_cells[d - 1], py_from_t[d - 1], out=scratch_b)
            torch.logaddexp(scratch_a, scratch_b, out=alpha_cells[d])
        if d in starts:
            bs, cols = starts[d]
            alpha[d, bs, cols] = 0.0

    end_d = boundary[:, 2] + boundary[:, 3]
    batch = torch.arange(B, device=device)
    scores = alpha[end_d, batch, boundary[:, 2] + 1]  # (B,)
    if not with_grad:
        return scores, None, None

    # ---- backward scores: beta[d, b, s+1] = log-sum over paths (s, d-s) -> end
    beta = torch.full((D + 1, B, S + 3), _NEG_INF, dtype=dtype, device=device)
    px_to_s = PX[:, :, 1 : S + 2].unbind(0)  # arc (s, t) -> (s+1, t)
    py_to_t = PY[:, :, 1 : S + 2].unbind(0)  # arc (s, t) -> (s, t+1)
    beta_shift = beta[:, :, 2 : S + 3].unbind(0)  # beta[s+1, .] in column s+1
    beta_cells = beta[:, :, 1 : S + 2].unbind(0)
    for d in range(d_last, -1, -1):
        if d < d_last:
            torch.add(px_to_s[d], beta_shift[d + 1], out=scratch_a)
            torch.add(py_to_t[d], beta_cells[d + 1], out=scratch_b)
            torch.logaddexp(scratch_a, scratch_b, out=beta_cells[d])
        if d in ends:
            bs, cols = ends[d]
            beta[d, bs, cols] = 0.0

    # ---- posteriors: exp(alpha + arc + beta(next) - total); -inf total -> 0
    total = torch.where(scores == _NEG_INF, torch.zeros_like(scores), scores)
    total = total.reshape(1, B, 1)
    a = alpha[:, :, 1 : S + 2]
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
    ``S + T + 1`` batched tensor ops), then the same backwards; the gradient is
    computed analytically from the two, so memory is ``O(B * S * T)``.

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
            f"py must have shape (B, S+1, T) = {(B, S + 1, T)} for px of shape "
            f"{tuple(px.shape)}, got {tuple(py.shape)}"
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


# --------------------------------------------------------------------------
# px / py for the different joiners
# --------------------------------------------------------------------------


def _check_lm_am_symbols(lm: Tensor, am: Tensor, symbols: Tensor, termination_symbol: int) -> Tuple[int, int, int, int]:
    if lm.ndim != 3 or am.ndim != 3:
        raise ValueError(f"lm (B, S+1, C) and am (B, T, C) must be 3-D, got {tuple(lm.shape)}, {tuple(am.shape)}")
    B, T, C = am.shape
    S = lm.shape[1] - 1
    if lm.shape[0] != B or lm.shape[2] != C or S < 0:
        raise ValueError(f"lm must be (B, S+1, C) with B={B}, C={C}; got {tuple(lm.shape)}")
    if symbols.shape != (B, S):
        raise ValueError(f"symbols must be (B, S) = {(B, S)}, got {tuple(symbols.shape)}")
    if not 0 <= termination_symbol < C:
        raise ValueError(f"termination_symbol {termination_symbol} not in [0, {C})")
    return B, S, T, C


def _append_neg_inf_column(x: Tensor) -> Tensor:
    """``(B, S, T)`` -> ``(B, S, T+1)`` with the new last column ``-inf``."""
    B, S, _ = x.shape
    return torch.cat([x, torch.full((B, S, 1), _NEG_INF, dtype=x.dtype, device=x.device)], dim=2)


def _simple_parts(lm: Tensor, am: Tensor, symbols: Tensor, termination_symbol: int):
    """Shared pieces of the simple and smoothed losses.

    Returns ``(lm_max (B,S+1,1), am_max (B,T,1), lm_probs (B,S+1,C),
    am_probs (B,T,C), normalizers (B,S+1,T), px_am (B,S,T), px_lm (B,S,1),
    py_am (B,1,T), py_lm (B,S+1,1))`` where ``normalizers[b,s,t] =
    logsumexp_c(lm[b,s,c] + am[b,t,c])`` computed without a (B,T,S+1,C)
    tensor: ``log(exp(lm - lm_max) @ exp(am - am_max)^T) + lm_max + am_max``.
    """
    B, S, T, C = _check_lm_am_symbols(lm, am, symbols, termination_symbol)
    lm_max = lm.max(dim=2, keepdim=True).values.detach()
    am_max = am.max(dim=2, keepdim=True).values.detach()
    lm_probs = (lm - lm_max).exp()
    am_probs = (am - am_max).exp()
    tiny = torch.finfo(lm.dtype).tiny
    normalizers = (
        torch.matmul(lm_probs, am_probs.transpose(1, 2)) + tiny
    ).log() + lm_max + am_max.transpose(1, 2)
    px_am = torch.gather(am, 2, symbols.unsqueeze(1).expand(B, T, S)).transpose(1, 2)
    px_lm = torch.gather(lm[:, :S], 2, symbols.unsqueeze(2))
    py_am = am[:, :, termination_symbol].unsqueeze(1)
    py_lm = lm[:, :, termination_symbol].unsqueeze(2)
    return lm_max, am_max, lm_probs, am_probs, normalizers, px_am, px_lm, py_am, py_lm


def get_rnnt_logprobs(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """px/py for the trivial joiner ``log_softmax(lm[b, s] + am[b, t])``.

    Args:
      lm: ``(B, S+1, C)`` prediction-network part of the logits.
      am: ``(B, T, C)`` encoder part of the logits.
      symbols: ``(B, S)`` int64 targets in ``[0, C)``.
      termination_symbol: blank id.
      boundary: ``(B, 4)`` or None.
    Returns:
      ``px`` ``(B, S, T+1)`` (``-inf`` at ``t = T`` and ``t = t_end_b``),
      ``py`` ``(B, S+1, T)``.
    """
    _, _, _, _, normalizers, px_am, px_lm, py_am, py_lm = _simple_parts(lm, am, symbols, termination_symbol)
    S = symbols.shape[1]
    px = _append_neg_inf_column(px_am + px_lm - normalizers[:, :S])
    py = py_am + py_lm - normalizers
    return _fix_for_boundary(px, boundary), py


def get_rnnt_logprobs_smoothed(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    lm_only_scale: float = 0.1,
    am_only_scale: float = 0.1,
    boundary: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """px/py interpolated (in log space) between three models, as k2:

    ``(1 - lm_only_scale - am_only_scale) * joint + lm_only_scale * lm_only
    + am_only_scale * am_only`` where ``joint = log_softmax(lm + am)``,
    ``lm_only = log_softmax(lm)`` and ``am_only = log_softmax(am + log
    unigram)``, the unigram being the mean of ``softmax(lm)`` over all
    ``B * (S+1)`` positions (padding included, as k2).

    Args/Returns: as :func:`get_rnnt_logprobs`.
    """
    (lm_max, am_max, lm_probs, am_probs, normalizers, px_am, px_lm, py_am, py_lm) = _simple_parts(
        lm, am, symbols, termination_symbol
    )
    B, S1, C = lm.shape
    S = S1 - 1
    T = am.shape[1]
    tiny = torch.finfo(lm.dtype).tiny

    lm_sums = lm_probs.sum(dim=2, keepdim=True)  # (B, S+1, 1)
    lmonly_normalizers = lm_sums.log() + lm_max  # (B, S+1, 1)
    unigram = (lm_probs / lm_sums).mean(dim=(0, 1)) + tiny  # (C,)
    log_unigram = unigram.log()
    amonly_normalizers = (
        torch.matmul(am_probs, unigram).log().unsqueeze(2) + am_max
    ).transpose(1, 2)  # (B, 1, T)

    px_joint = px_am + px_lm - normalizers[:, :S]  # (B, S, T)
    px_lmonly = px_lm - lmonly_normalizers[:, :S]  # (B, S, 1)
    px_amonly = px_am + log_unigram[symbols].unsqueeze(2) - amonly_normalizers  # (B, S, T)
    py_joint = py_am + py_lm - normalizers  # (B, S+1, T)
    py_lmonly = py_lm - lmonly_normalizers  # (B, S+1, 1)
    py_amonly = py_am + log_unigram[termination_symbol] - amonly_normalizers  # (B, 1, T)

    combined_scale = 1.0 - lm_only_scale - am_only_scale
    # All terms are finite here; the -inf column is appended afterwards, so a
    # zero scale never multiplies -inf.
    px = px_joint * combined_scale + px_lmonly * lm_only_scale + px_amonly * am_only_scale
    py = py_joint * combined_scale + py_lmonly * lm_only_scale + py_amonly * am_only_scale
    px = _append_neg_inf_column(px.expand(B, S, T))
    return _fix_for_boundary(px, boundary), py.expand(B, S + 1, T)


# Rows of ``logits`` whose logsumexp is taken at once in ``_LogSoftmaxArcs``:
# torch.logsumexp allocates a temporary of its input's size, so on a lattice of
# logits it would add one more lattice-sized tensor to the peak memory.
_LOGSUMEXP_CHUNK_ELEMENTS = 1 << 20


def _logsumexp_last_dim(x: Tensor) -> Tensor:
    """``torch.logsumexp(x, dim=-1, keepdim=True)`` computed over chunks of rows,
    so its temporaries stay below ``_LOGSUMEXP_CHUNK_ELEMENTS`` elements.

    Args:
      x: ``(..., C)``.
    Returns:
      ``(..., 1)``.
    """
    C = x.shape[-1]
    rows = x.reshape(-1, C)
    out = torch.empty((rows.shape[0], 1), dtype=x.dtype, device=x.device)
    chunk = max(1, _LOGSUMEXP_CHUNK_ELEMENTS // max(C, 1))
    for start in range(0, rows.shape[0], chunk):
        torch.logsumexp(rows[start : start + chunk], dim=-1, keepdim=True, out=out[start : start + chunk])
    return out.reshape(x.shape[:-1] + (1,))


class _LogSoftmaxArcs(torch.autograd.Function):
    """``log_softmax(logits)`` read at two entries per cell, without a
    normalised copy of ``logits``.

    Forward keeps only ``logits`` (which the joiner's backward needs anyway)
    and the ``(..., 1)`` normalisers; backward writes the gradient into one
    new tensor of the size of ``logits``:
    ``-softmax(logits) * (g_sym + g_blank)``, plus ``g_sym`` at the symbol and
    ``g_blank`` at the blank.  Autograd through ``logsumexp`` + ``gather`` +
    indexing would instead hold three logits-sized gradients plus the
    temporaries of ``logsumexp``'s backward at once.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, symbols: Tensor, blank: int):  # type: ignore[override]
        normalizers = _logsumexp_last_dim(logits)  # (..., 1)
        px = torch.gather(logits, -1, symbols.unsqueeze(-1)).squeeze(-1) - normalizers.squeeze(-1)
        py = logits[..., blank] - normalizers.squeeze(-1)
        ctx.save_for_backward(logits, normalizers, symbols)
        ctx.blank = blank
        return px, py

    @staticmethod
    def backward(ctx, grad_px: Optional[Tensor], grad_py: Optional[Tensor]):  # type: ignore[override]
        logits, normalizers, symbols = ctx.saved_tensors
        zeros = torch.zeros((), dtype=logits.dtype, device=logits.device)
        grad_px = zeros.expand(symbols.shape) if grad_px is None else grad_px
        grad_py = zeros.expand(symbols.shape) if grad_py is None else grad_py
        grad = torch.sub(logits, normalizers).exp_()  # softmax, the one logits-sized allocation
        grad.mul_((grad_px + grad_py).neg().unsqueeze(-1))
        grad.scatter_add_(-1, symbols.unsqueeze(-1), grad_px.unsqueeze(-1).to(grad.dtype))
        grad[..., ctx.blank] += grad_py
        return grad, None, None


def _log_softmax_arcs(logits: Tensor, symbols: Tensor, blank: int) -> Tuple[Tensor, Tensor]:
    """Symbol and blank log-probabilities of every joiner cell.

    Args:
      logits: ``(..., C)`` unnormalised joiner output.
      symbols: int64, the shape of ``logits`` without its last dim: the symbol
        whose log-probability is wanted in each cell.
      blank: blank id.
    Returns:
      ``px[...] = log_softmax(logits)[..., symbols[...]]`` and
      ``py[...] = log_softmax(logits)[..., blank]``, both of ``symbols``' shape.
    """
    return _LogSoftmaxArcs.apply(logits, symbols, blank)


def get_rnnt_logprobs_joint(
    logits: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """px/py from full joiner output.

    Args:
      logits: ``(B, T, S+1, C)`` unnormalised.
      symbols: ``(B, S)`` int64 in ``[0, C)``.
      termination_symbol: blank id.
      boundary: ``(B, 4)`` or None.
    Returns:
      ``px`` ``(B, S, T+1)``, ``py`` ``(B, S+1, T)`` (log-softmax entries;
      computed as ``logits - logsumexp`` so no normalised copy of ``logits``
      is kept).
    """
    if logits.ndim != 4:
        raise ValueError(f"logits must be (B, T, S+1, C), got {tuple(logits.shape)}")
    B, T, S1, C = logits.shape
    S = S1 - 1
    if symbols.shape != (B, S):
        raise ValueError(f"symbols must be (B, S) = {(B, S)}, got {tuple(symbols.shape)}")
    if not 0 <= termination_symbol < C:
        raise ValueError(f"termination_symbol {termination_symbol} not in [0, {C})")
    term = torch.full((B, 1), termination_symbol, dtype=torch.int64, device=symbols.device)
    symbols_ext = torch.cat([symbols.to(torch.int64), term], dim=1)  # (B, S+1); px of row S is dropped
    px, py = _log_softmax_arcs(logits, symbols_ext.reshape(B, 1, S1).expand(B, T, S1), termination_symbol)
    px = px[:, :, :S].transpose(1, 2)  # (B, S, T)
    py = py.transpose(1, 2)  # (B, S+1, T)
    px = _append_neg_inf_column(px)
    return _fix_for_boundary(px, boundary), py.contiguous()


def get_rnnt_logprobs_pruned(
    logits: Tensor,
    symbols: Tensor,
    ranges: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """px/py from pruned joiner output; cells outside the window are ``-inf``.

    Args:
      logits: ``(B, T, R, C)``; ``logits[b, t, r]`` belongs to symbol
        position ``s = ranges[b, t, r]``.
      symbols: ``(B, S)`` int64 in ``[0, C)``.
      ranges: ``(B, T, R)`` int64 in ``[0, S]``, distinct along ``R`` (as
        from :func:`get_rnnt_prune_ranges`).
      termination_symbol: blank id.
      boundary: ``(B, 4)`` or None.
    Returns:
      ``px`` ``(B, S, T+1)``, ``py`` ``(B, S+1, T)``.
    """
    if logits.ndim != 4:
        raise ValueError(f"logits must be (B, T, s_range, C), got {tuple(logits.shape)}")
    B, T, R, C = logits.shape
    if ranges.shape != (B, T, R):
        raise ValueError(f"ranges must be (B, T, s_range) = {(B, T, R)}, got {tuple(ranges.shape)}")
    if symbols.ndim != 2 or symbols.shape[0] != B:
        raise ValueError(f"symbols must be (B, S) with B={B}, got {tuple(symbols.shape)}")
    S = symbols.shape[1]
    if R > S + 1:
        raise ValueError(f"s_range {R} > S + 1 = {S + 1}")
    if not 0 <= termination_symbol < C:
        raise ValueError(f"termination_symbol {termination_symbol} not in [0, {C})")
    ranges = ranges.to(torch.int64)

    term = torch.full((B, 1), termination_symbol, dtype=torch.int64, device=symbols.device)
    symbols_ext = torch.cat([symbols.to(torch.int64), term], dim=1)  # (B, S+1)
    pruned_symbols = torch.gather(symbols_ext.unsqueeze(1).expand(B, T, S + 1), 2, ranges)  # (B, T, R)
    px_win, py_win = _log_softmax_arcs(logits, pruned_symbols, termination_symbol)

    full = torch.full((B, T, S + 1), _NEG_INF, dtype=logits.dtype, device=logits.device)
    px = full.scatter(2, ranges, px_win)[:, :, :S].transpose(1, 2)  # (B, S, T)
    py = full.scatter(2, ranges, py_win).transpose(1, 2).contiguous()  # (B, S+1, T)
    px = _append_neg_inf_column(px)
    return _fix_for_boundary(px, boundary), py


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
    out = mutual_information_recursion(px, py, boundary, return_grad)
    if return_grad:
        scores, grads = out  # type: ignore[misc]
        return _reduce(-scores, reduction), grads
    return _reduce(-out, reduction)  # type: ignore[operator]


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
    px, py = get_rnnt_logprobs_smoothed(
        lm, am, symbols, termination_symbol, lm_only_scale, am_only_scale, boundary
    )
    out = mutual_information_recursion(px, py, boundary, return_grad)
    if return_grad:
        scores, grads = out  # type: ignore[misc]
        return _reduce(-scores, reduction), grads
    return _reduce(-out, reduction)  # type: ignore[operator]


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
    scores = mutual_information_recursion(px, py, boundary)
    return _reduce(-scores, reduction)  # type: ignore[operator]


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
        raise ValueError(f"targets must be (B, U) = {(B, U)} for logits {tuple(logits.shape)}, got {tuple(targets.shape)}")
    if logit_lengths.shape != (B,) or target_lengths.shape != (B,):
        raise ValueError("logit_lengths and target_lengths must be (B,)")
    device = logits.device
    boundary = make_boundary(target_lengths.to(device), logit_lengths.to(device))
    targets = targets.to(device=device, dtype=torch.int64)
    valid = torch.arange(U, device=device).unsqueeze(0) < boundary[:, 2:3]
    symbols = torch.where(valid, targets, torch.full_like(targets, blank))
    px, py = get_rnnt_logprobs_joint(logits, symbols, blank, boundary)
    scores = mutual_information_recursion(px, py, boundary)
    return _reduce(-scores, reduction)
