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
joiners in :mod:`icefall_lite.nn.rnnt_logprobs`, the pruned loss's windows in
:mod:`icefall_lite.nn.rnnt_pruning`; this module holds the losses and
re-exports every public name of k2's.

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
from icefall_lite.nn.rnnt_pruning import do_rnnt_pruning, get_rnnt_prune_ranges, get_rnnt_prune_ranges_deprecated

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
