"""Pure-PyTorch RNN-T losses with k2's API.

k2 (``k2/python/k2/rnnt_loss.py``, ``mutual_information.py``) is not
installable next to a modern torch, so this module re-implements the
functions an icefall recipe uses, with k2's names, argument names, argument
orders, defaults, return shapes and semantics (k2's own tests of
``rnnt_loss.py`` and ``mutual_information.py`` pass against it on CPU):

- :func:`mutual_information_recursion`, :func:`joint_mutual_information_recursion`:
  the lattice recursion every loss reduces to, with an analytic backward run
  in float64, so float32 gradients carry no rounding of the large lattice
  scores (issue 28).
- :func:`rnnt_loss_simple`, :func:`rnnt_loss_smoothed`: the "trivial joiner"
  losses (joint = lm + am) used to find pruning bounds.
- :func:`get_rnnt_prune_ranges`, :func:`do_rnnt_pruning`,
  :func:`rnnt_loss_pruned`: the pruned loss of arXiv 2206.13236 (and the HAT
  variant, ``use_hat_loss=True``); :func:`get_rnnt_prune_ranges_deprecated`,
  k2's earlier way of choosing the windows.
- :func:`rnnt_loss`: the RNN-T loss on full ``(B, T, S+1, C)`` logits, k2's
  signature.
- :func:`rnnt_loss_torchaudio`: the same loss with torchaudio's argument
  order (lengths instead of a boundary), which :func:`rnnt_loss` had before.

Every loss takes k2's ``rnnt_type`` (``"regular"``, ``"modified"``,
``"constrained"``; see :mod:`icefall_lite.nn.rnnt_logprobs`), ``delay_penalty``
(see :func:`apply_delay_penalty`) and ``reduction``, and computes in at least
float32 with autocast off: float16/bfloat16 scores are cast up first
(:func:`computed_in_float32`).

The lattice recursion and the ``boundary`` helpers live in
:mod:`icefall_lite.nn.mutual_information`, the ``px``/``py`` scores of the
joiners in :mod:`icefall_lite.nn.rnnt_logprobs`; this module holds the losses
and re-exports every public name.

Conventions
-----------
Lattice: ``p[b, s, t]`` is the log-score of having emitted ``s`` symbols and
consumed ``t`` frames; ``px[b, s, t]`` scores emitting symbol ``s`` from cell
``(s, t)`` (to ``(s+1, t)`` for regular RNN-T, to ``(s+1, t+1)`` for modified
and constrained), ``py[b, s, t]`` scores ``(s, t) -> (s, t+1)`` (blank).

``boundary`` is an int64 tensor ``(B, 4)`` with rows
``[s_begin, t_begin, s_end, t_end]``; for transducer training it is
``[0, 0, U_b, T_b]`` (number of target symbols, number of frames), see
:func:`make_boundary`.  ``None`` means ``[0, 0, S, T]`` for every sequence.

Reductions (as k2 and torchaudio): ``"none"`` returns the ``(B,)`` losses,
``"sum"`` their sum, ``"mean"`` their mean over the batch (``sum / B``; not
divided by lengths).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Tuple, TypeVar, Union

import torch

from icefall_lite.nn.mutual_information import (
    fix_for_boundary,
    joint_mutual_information_recursion,
    make_boundary,
    mutual_information_recursion,
    upcast_half,
)
from icefall_lite.nn.rnnt_logprobs import (
    get_hat_logprobs_pruned,
    get_rnnt_logprobs,
    get_rnnt_logprobs_joint,
    get_rnnt_logprobs_pruned,
    get_rnnt_logprobs_smoothed,
)

Tensor = torch.Tensor
T_co = TypeVar("T_co")

__all__ = [
    "make_boundary",
    "fix_for_boundary",
    "mutual_information_recursion",
    "joint_mutual_information_recursion",
    "get_rnnt_logprobs",
    "get_rnnt_logprobs_smoothed",
    "get_rnnt_logprobs_joint",
    "get_rnnt_logprobs_pruned",
    "get_hat_logprobs_pruned",
    "apply_delay_penalty",
    "rnnt_loss_simple",
    "rnnt_loss_smoothed",
    "get_rnnt_prune_ranges",
    "get_rnnt_prune_ranges_deprecated",
    "do_rnnt_pruning",
    "rnnt_loss_pruned",
    "rnnt_loss",
    "rnnt_loss_torchaudio",
]


def computed_in_float32(loss_fn: Callable[..., T_co]) -> Callable[..., T_co]:
    """A loss that takes half-precision scores and computes in float32, with autocast off.

    In float16 the occupancy posteriors of a lattice fall below the smallest
    normal number and are flushed to zero (every gradient 0.0), and scores
    overflow past 65504; bfloat16 keeps 8 bits of mantissa. So float16/bfloat16
    arguments are cast to float32 (their gradients come back in their own
    dtype through the cast) and the loss is float32.
    """

    @functools.wraps(loss_fn)
    def wrapper(*args: Any, **kwargs: Any) -> T_co:
        args = tuple(upcast_half(a) for a in args)
        kwargs = {k: upcast_half(v) for k, v in kwargs.items()}
        device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
        with torch.autocast(device_type=device.type, enabled=False):
            return loss_fn(*args, **kwargs)

    return wrapper


def _reduce(loss: Tensor, reduction: Optional[str]) -> Tensor:
    """Apply ``"none"`` | ``"mean"`` (over batch) | ``"sum"`` to ``(B,)`` losses."""
    if reduction == "none":
        return loss
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    raise ValueError(f"reduction should be 'none', 'mean' or 'sum', given {reduction!r}")


def apply_delay_penalty(px: Tensor, boundary: Optional[Tensor], rnnt_type: str, delay_penalty: float) -> Tensor:
    """k2's delay penalty (k2 issue 955): reward early symbols, penalise late ones.

    For ``delay_penalty > 0`` every symbol arc on frame ``t`` gets
    ``delay_penalty * ((T_b - 1) / 2 - t)`` added (``T_b = t_end`` of the
    sequence, ``T`` without a boundary), so the loss changes by
    ``delay_penalty`` times the mean frame of the symbols minus the middle
    frame.  ``delay_penalty <= 0`` leaves ``px`` unchanged, as in k2.  The
    penalty is computed in ``px``'s dtype (k2 computes it in float32).

    Args:
      px: ``(B, S, T+1)`` (regular) or ``(B, S, T)``.
      boundary: ``(B, 4)`` or None; rnnt_type: which of the two ``px`` shapes.
      delay_penalty: the scale.
    Returns:
      ``px`` plus the penalty (a new tensor), or ``px`` itself.
    """
    if delay_penalty <= 0.0:
        return px
    B, _, T0 = px.shape
    T = T0 - 1 if rnnt_type == "regular" else T0
    if boundary is None:
        t_end = torch.full((B,), T, dtype=px.dtype, device=px.device)
    else:
        t_end = boundary[:, 3].to(device=px.device, dtype=px.dtype)
    offset = ((t_end - 1) / 2).reshape(B, 1, 1)
    frames = torch.arange(T0, device=px.device, dtype=px.dtype).reshape(1, 1, T0)
    return px + (offset - frames) * delay_penalty


def _lattice_loss(
    px: Tensor,
    py: Tensor,
    boundary: Optional[Tensor],
    rnnt_type: str,
    delay_penalty: float,
    reduction: Optional[str],
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """The reduced ``-log`` total score of the lattice ``px``, ``py`` ``(B, S+1, T)``
    after the delay penalty.

    With ``return_grad``: ``(loss, (px_grad, py_grad))``, the occupancy posteriors
    (of the penalised lattice, as k2).
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction should be 'none', 'mean' or 'sum', given {reduction!r}")
    px = apply_delay_penalty(px, boundary, rnnt_type, delay_penalty)
    out = mutual_information_recursion(px, py, boundary, return_grad)
    if return_grad:
        scores, grads = out  # type: ignore[misc]
        return _reduce(-scores, reduction), grads
    return _reduce(-out, reduction)  # type: ignore[operator]


# --------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------


@computed_in_float32
def rnnt_loss_simple(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    reduction: Optional[str] = "mean",
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """RNN-T loss with the trivial joiner ``logits = lm[b, s] + am[b, t]`` (k2's signature).

    Args:
      lm: ``(B, S+1, C)``; am: ``(B, T, C)``; symbols: ``(B, S)`` int64;
      termination_symbol: blank id; boundary: ``(B, 4)`` or None;
      rnnt_type: ``"regular"`` | ``"modified"`` | ``"constrained"``;
      delay_penalty: see :func:`apply_delay_penalty`;
      reduction: ``"none"`` | ``"mean"`` (over batch) | ``"sum"``;
      return_grad: also return the occupancy posteriors for pruning.
    Returns:
      loss (``(B,)`` or scalar) = ``-log P(symbols | am, lm)``, or
      ``(loss, (px_grad, py_grad))`` with ``px_grad`` of ``px``'s shape
      (``(B, S, T+1)`` regular, ``(B, S, T)`` otherwise) and ``py_grad``
      ``(B, S+1, T)``: ``d(-loss_b) / d px``, ``d(-loss_b) / d py`` per sequence.
    """
    px, py = get_rnnt_logprobs(lm, am, symbols, termination_symbol, rnnt_type=rnnt_type, boundary=boundary)
    return _lattice_loss(px, py, boundary, rnnt_type, delay_penalty, reduction, return_grad)


@computed_in_float32
def rnnt_loss_smoothed(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    lm_only_scale: float = 0.1,
    am_only_scale: float = 0.1,
    boundary: Optional[Tensor] = None,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    reduction: Optional[str] = "mean",
    return_grad: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tuple[Tensor, Tensor]]]:
    """Simple RNN-T loss with LM-only / AM-only smoothing (see
    :func:`get_rnnt_logprobs_smoothed`), k2's signature.  With both scales 0
    it equals :func:`rnnt_loss_simple`.

    Args/Returns: as :func:`rnnt_loss_simple`, plus the two scales.
    """
    px, py = get_rnnt_logprobs_smoothed(
        lm, am, symbols, termination_symbol, lm_only_scale, am_only_scale, boundary=boundary, rnnt_type=rnnt_type
    )
    return _lattice_loss(px, py, boundary, rnnt_type, delay_penalty, reduction, return_grad)


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


@computed_in_float32
def rnnt_loss_pruned(
    logits: Tensor,
    symbols: Tensor,
    ranges: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    reduction: Optional[str] = "mean",
    use_hat_loss: bool = False,
) -> Tensor:
    """RNN-T loss over the pruned lattice (arcs outside the windows removed), k2's signature.

    Args:
      logits: ``(B, T, R, C)`` joiner output on the windows
        (from :func:`do_rnnt_pruning` + joiner).
      symbols: ``(B, S)`` int64; ranges: ``(B, T, R)`` int64;
      termination_symbol: blank id; boundary: ``(B, 4)`` or None;
      rnnt_type: ``"regular"`` | ``"modified"`` | ``"constrained"``;
      delay_penalty: see :func:`apply_delay_penalty`;
      reduction: ``"none"`` | ``"mean"`` (over batch) | ``"sum"``;
      use_hat_loss: score the windows with :func:`get_hat_logprobs_pruned`
        (HAT; blank id 0) instead of a softmax.
    Returns:
      ``(B,)`` losses or a scalar.  Equals the full loss when ``R = S + 1``.
    """
    get_logprobs = get_hat_logprobs_pruned if use_hat_loss else get_rnnt_logprobs_pruned
    px, py = get_logprobs(logits, symbols, ranges, termination_symbol, boundary, rnnt_type=rnnt_type)
    return _lattice_loss(px, py, boundary, rnnt_type, delay_penalty, reduction)  # type: ignore[return-value]


@computed_in_float32
def rnnt_loss(
    logits: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor] = None,
    rnnt_type: str = "regular",
    delay_penalty: float = 0.0,
    reduction: Optional[str] = "mean",
) -> Tensor:
    """Full RNN-T loss on joiner output, k2's signature.

    Args:
      logits: ``(B, T, S+1, C)`` unnormalised joiner output (float32/64; float16/bfloat16 are cast to float32).
      symbols: ``(B, S)`` int64 in ``[0, C)``.
      termination_symbol: blank id.
      boundary: ``(B, 4)`` ``[0, 0, U_b, T_b]`` or None (``[0, 0, S, T]``).
      rnnt_type: ``"regular"`` | ``"modified"`` | ``"constrained"``.
      delay_penalty: see :func:`apply_delay_penalty`.
      reduction: ``"none"`` -> ``(B,)``, ``"sum"``, or ``"mean"`` over the batch.
    Returns:
      ``-log P(symbols | logits)`` per sequence, reduced.
    """
    px, py = get_rnnt_logprobs_joint(logits, symbols, termination_symbol, rnnt_type=rnnt_type, boundary=boundary)
    return _lattice_loss(px, py, boundary, rnnt_type, delay_penalty, reduction)  # type: ignore[return-value]


@computed_in_float32
def rnnt_loss_torchaudio(
    logits: Tensor,
    targets: Tensor,
    logit_lengths: Tensor,
    target_lengths: Tensor,
    blank: int = 0,
    reduction: str = "mean",
) -> Tensor:
    """Full regular RNN-T loss with torchaudio's argument order
    (``torchaudio.functional.rnnt_loss``; what :func:`rnnt_loss` was here
    before it took k2's signature).

    The same loss as :func:`rnnt_loss` with ``boundary = [0, 0,
    target_lengths, logit_lengths]``.  Differences from torchaudio: the blank
    id defaults to 0 (torchaudio: -1, the last class); there is no ``clamp``
    and no ``fused_log_softmax`` (the log-softmax is always taken here).

    Args:
      logits: ``(B, T, U+1, V)`` unnormalised joiner output (float32/64; float16/bfloat16 are cast to float32).
      targets: ``(B, U)`` integer; entries at ``u >= target_lengths[b]`` are
        ignored (any value, e.g. padding -1).
      logit_lengths: ``(B,)`` frames ``T_b <= T``.
      target_lengths: ``(B,)`` symbols ``U_b <= U``.
      blank: blank id; a negative id counts from the end, as in torchaudio.
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
    symbols = torch.where(valid, targets, torch.full_like(targets, blank % V))
    return rnnt_loss(logits, symbols, blank % V, boundary=boundary, reduction=reduction)
