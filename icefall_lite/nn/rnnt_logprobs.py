"""``px`` / ``py`` lattice scores (k2's ``get_rnnt_logprobs*``) for the different joiners.

Part of :mod:`icefall_lite.nn.rnnt_loss` (which re-exports the public names and
states the lattice conventions): the trivial joiner ``lm + am``
(:func:`get_rnnt_logprobs`, :func:`get_rnnt_logprobs_smoothed`), full logits
``(B, T, S+1, C)`` (:func:`get_rnnt_logprobs_joint`) and pruned logits
``(B, T, s_range, C)`` (:func:`get_rnnt_logprobs_pruned`,
:func:`get_hat_logprobs_pruned`).

Every function takes k2's ``rnnt_type``:

- ``"regular"``: a symbol keeps the frame; ``px`` is ``(B, S, T+1)`` with
  ``-inf`` in column ``T`` and in column ``t_end_b`` of each sequence.
- ``"modified"``: a symbol also advances the frame (at most one symbol per
  frame); ``px`` is ``(B, S, T)``.
- ``"constrained"``: the lattice of ``"modified"``, but emitting symbol ``s``
  on frame ``t`` also pays the blank of the next context on that frame:
  ``px[b, s, t] += py[b, s+1, t]``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from icefall_lite.nn.boundary import NEG_INF, fix_for_boundary

Tensor = torch.Tensor

__all__ = [
    "RNNT_TYPES",
    "get_rnnt_logprobs",
    "get_rnnt_logprobs_smoothed",
    "get_rnnt_logprobs_joint",
    "get_rnnt_logprobs_pruned",
    "get_hat_logprobs_pruned",
]

RNNT_TYPES = ("regular", "modified", "constrained")


# --------------------------------------------------------------------------
# px / py for the different joiners
# --------------------------------------------------------------------------


def check_rnnt_type(rnnt_type: str, S: int, T: int, boundary: Optional[Tensor]) -> None:
    """Reject an unknown ``rnnt_type``, and lattices the modified ones cannot cross.

    The modified and constrained lattices consume a frame with every symbol,
    so they need ``T_b >= S_b`` for every sequence (``T >= S`` without a
    boundary), as k2 requires.

    Args:
      rnnt_type: one of :data:`RNNT_TYPES`.
      S, T: lattice size; boundary: ``(B, 4)`` or None.
    """
    if rnnt_type not in RNNT_TYPES:
        raise ValueError(f"rnnt_type must be one of {RNNT_TYPES}, got {rnnt_type!r}")
    if rnnt_type == "regular":
        return
    if boundary is None:
        if T < S:
            raise ValueError(f"rnnt_type {rnnt_type!r} needs T >= S, got T={T} and S={S}")
    elif bool((boundary[:, 3] < boundary[:, 2]).any()):
        raise ValueError(
            f"rnnt_type {rnnt_type!r} needs t_end >= s_end for every sequence, got boundary {boundary.tolist()}"
        )


def finish_px(px: Tensor, py: Tensor, rnnt_type: str, boundary: Optional[Tensor]) -> Tensor:
    """Shape symbol-arc scores ``px`` ``(B, S, T)`` for ``rnnt_type``.

    Regular: append the ``-inf`` column ``T`` and set ``px[b, :, t_end_b] =
    -inf`` -> ``(B, S, T+1)``; constrained: add the blank score of the next
    context, ``py[:, 1:]`` -> ``(B, S, T)``; modified: unchanged.

    Args:
      px: ``(B, S, T)``; py: ``(B, S+1, T)``; boundary: ``(B, 4)`` or None.
    """
    if rnnt_type == "regular":
        return fix_for_boundary(_append_neg_inf_column(px), boundary)
    if rnnt_type == "constrained":
        return px + py[:, 1:, :]
    return px


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
    return torch.cat([x, torch.full((B, S, 1), NEG_INF, dtype=x.dtype, device=x.device)], dim=2)


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
    normalizers = (torch.matmul(lm_probs, am_probs.transpose(1, 2)) + tiny).log() + lm_max + am_max.transpose(1, 2)
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
    rnnt_type: str = "regular",
    boundary: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """px/py for the trivial joiner ``log_softmax(lm[b, s] + am[b, t])`` (k2's arguments, in k2's order).

    Args:
      lm: ``(B, S+1, C)`` prediction-network part of the logits.
      am: ``(B, T, C)`` encoder part of the logits.
      symbols: ``(B, S)`` int64 targets in ``[0, C)``.
      termination_symbol: blank id.
      rnnt_type: ``"regular"`` | ``"modified"`` | ``"constrained"``.
      boundary: ``(B, 4)`` or None.
    Returns:
      ``px`` ``(B, S, T+1)`` (regular: ``-inf`` at ``t = T`` and ``t = t_end_b``)
      or ``(B, S, T)`` (modified, constrained), ``py`` ``(B, S+1, T)``.
    """
    _, _, _, _, normalizers, px_am, px_lm, py_am, py_lm = _simple_parts(lm, am, symbols, termination_symbol)
    S = symbols.shape[1]
    check_rnnt_type(rnnt_type, S, am.shape[1], boundary)
    py = py_am + py_lm - normalizers
    return finish_px(px_am + px_lm - normalizers[:, :S], py, rnnt_type, boundary), py


def get_rnnt_logprobs_smoothed(
    lm: Tensor,
    am: Tensor,
    symbols: Tensor,
    termination_symbol: int,
    lm_only_scale: float = 0.1,
    am_only_scale: float = 0.1,
    boundary: Optional[Tensor] = None,
    rnnt_type: str = "regular",
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
    check_rnnt_type(rnnt_type, S, T, boundary)
    combined_scale = 1.0 - lm_only_scale - am_only_scale
    px = (px_am + px_lm - normalizers[:, :S]) * combined_scale  # (B, S, T)
    py = (py_am + py_lm - normalizers) * combined_scale  # (B, S+1, T)
    # A term whose scale is zero is left out: it is finite, so it would add
    # exactly zero (the -inf column is appended afterwards).
    if lm_only_scale != 0.0:
        lmonly_normalizers = lm_probs.sum(dim=2, keepdim=True).log() + lm_max  # (B, S+1, 1)
        px = px + (px_lm - lmonly_normalizers[:, :S]) * lm_only_scale  # (B, S, 1) term
        py = py + (py_lm - lmonly_normalizers) * lm_only_scale  # (B, S+1, 1) term
    if am_only_scale != 0.0:
        tiny = torch.finfo(lm.dtype).tiny
        unigram = (lm_probs / lm_probs.sum(dim=2, keepdim=True)).mean(dim=(0, 1)) + tiny  # (C,)
        log_unigram = unigram.log()
        amonly_normalizers = (torch.matmul(am_probs, unigram).log().unsqueeze(2) + am_max).transpose(1, 2)  # (B, 1, T)
        px = px + (px_am + log_unigram[symbols].unsqueeze(2) - amonly_normalizers) * am_only_scale
        py = py + (py_am + log_unigram[termination_symbol] - amonly_normalizers) * am_only_scale
    py = py.expand(B, S + 1, T)
    return finish_px(px.expand(B, S, T), py, rnnt_type, boundary), py


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

    Forward keeps only ``logits`` (which the joiner's backward needs anyway);
    backward recomputes ``softmax(logits)`` (one fused kernel, cheaper than
    subtracting saved normalisers) into the one new tensor of the size of
    ``logits`` and turns it into the gradient:
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
        ctx.save_for_backward(logits, symbols)
        ctx.blank = blank
        return px, py

    @staticmethod
    def backward(ctx, grad_px: Optional[Tensor], grad_py: Optional[Tensor]):  # type: ignore[override]
        logits, symbols = ctx.saved_tensors
        zeros = torch.zeros((), dtype=logits.dtype, device=logits.device)
        grad_px = zeros.expand(symbols.shape) if grad_px is None else grad_px
        grad_py = zeros.expand(symbols.shape) if grad_py is None else grad_py
        grad = torch.softmax(logits, dim=-1)  # the one logits-sized allocation
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
    rnnt_type: str = "regular",
    boundary: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """px/py from full joiner output (k2's arguments, in k2's order).

    Args:
      logits: ``(B, T, S+1, C)`` unnormalised.
      symbols: ``(B, S)`` int64 in ``[0, C)``.
      termination_symbol: blank id.
      rnnt_type: ``"regular"`` | ``"modified"`` | ``"constrained"``.
      boundary: ``(B, 4)`` or None.
    Returns:
      ``px`` ``(B, S, T+1)`` (regular) or ``(B, S, T)``, ``py`` ``(B, S+1, T)``
      (log-softmax entries; computed as ``logits - logsumexp`` so no
      normalised copy of ``logits`` is kept).
    """
    if logits.ndim != 4:
        raise ValueError(f"logits must be (B, T, S+1, C), got {tuple(logits.shape)}")
    B, T, S1, C = logits.shape
    S = S1 - 1
    if symbols.shape != (B, S):
        raise ValueError(f"symbols must be (B, S) = {(B, S)}, got {tuple(symbols.shape)}")
    if not 0 <= termination_symbol < C:
        raise ValueError(f"termination_symbol {termination_symbol} not in [0, {C})")
    check_rnnt_type(rnnt_type, S, T, boundary)
    term = torch.full((B, 1), termination_symbol, dtype=torch.int64, device=symbols.device)
    symbols_ext = torch.cat([symbols.to(torch.int64), term], dim=1)  # (B, S+1); px of row S is dropped
    px, py = _log_softmax_arcs(logits, symbols_ext.reshape(B, 1, S1).expand(B, T, S1), termination_symbol)
    px = px[:, :, :S].transpose(1, 2)  # (B, S, T)
    py = py.transpose(1, 2).contiguous()  # (B, S+1, T)
    return finish_px(px, py, rnnt_type, boundary), py


def _check_pruned(
    logits: Tensor, symbols: Tensor, ranges: Tensor, termination_symbol: int
) -> Tuple[int, int, int, int, int]:
    """Validate the pruned-loss inputs; returns ``(B, T, R, C, S)``."""
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
    return B, T, R, C, S


def _window_symbols(symbols: Tensor, ranges: Tensor, termination_symbol: int) -> Tensor:
    """The symbol each window cell would emit: ``(B, T, R)`` int64, ``symbols[b, ranges[b, t, r]]``
    with the termination symbol for position ``S``."""
    B, T, _ = ranges.shape
    S = symbols.shape[1]
    term = torch.full((B, 1), termination_symbol, dtype=torch.int64, device=symbols.device)
    symbols_ext = torch.cat([symbols.to(torch.int64), term], dim=1)  # (B, S+1)
    return torch.gather(symbols_ext.unsqueeze(1).expand(B, T, S + 1), 2, ranges)


def _unprune(
    px_win: Tensor, py_win: Tensor, ranges: Tensor, S: int, rnnt_type: str, boundary: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """Scatter window scores ``(B, T, R)`` onto the full lattice (``-inf`` outside the windows).

    Returns:
      ``px`` ``(B, S, T+1)`` (regular) or ``(B, S, T)``, ``py`` ``(B, S+1, T)``.
    """
    B, T, _ = ranges.shape
    full = torch.full((B, T, S + 1), NEG_INF, dtype=px_win.dtype, device=px_win.device)
    px = full.scatter(2, ranges, px_win)[:, :, :S].transpose(1, 2)  # (B, S, T)
    py = full.scatter(2, ranges, py_win).transpose(1, 2).contiguous()  # (B, S+1, T)
    return finish_px(px, py, rnnt_type, boundary), py


def get_rnnt_logprobs_pruned(
    logits: Tensor,
    symbols: Tensor,
    ranges: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor],
    rnnt_type: str = "regular",
) -> Tuple[Tensor, Tensor]:
    """px/py from pruned joiner output; cells outside the window are ``-inf`` (k2's arguments).

    Args:
      logits: ``(B, T, R, C)``; ``logits[b, t, r]`` belongs to symbol
        position ``s = ranges[b, t, r]``.
      symbols: ``(B, S)`` int64 in ``[0, C)``.
      ranges: ``(B, T, R)`` int64 in ``[0, S]``, distinct along ``R`` (as
        from :func:`get_rnnt_prune_ranges`).
      termination_symbol: blank id.
      boundary: ``(B, 4)`` or None (required positionally, as in k2).
      rnnt_type: ``"regular"`` | ``"modified"`` | ``"constrained"``.
    Returns:
      ``px`` ``(B, S, T+1)`` (regular) or ``(B, S, T)``, ``py`` ``(B, S+1, T)``.
    """
    B, T, R, C, S = _check_pruned(logits, symbols, ranges, termination_symbol)
    check_rnnt_type(rnnt_type, S, T, boundary)
    ranges = ranges.to(torch.int64)
    px_win, py_win = _log_softmax_arcs(logits, _window_symbols(symbols, ranges, termination_symbol), termination_symbol)
    return _unprune(px_win, py_win, ranges, S, rnnt_type, boundary)


def get_hat_logprobs_pruned(
    logits: Tensor,
    symbols: Tensor,
    ranges: Tensor,
    termination_symbol: int,
    boundary: Optional[Tensor],
    rnnt_type: str = "regular",
) -> Tuple[Tensor, Tensor]:
    """px/py of the Hybrid Autoregressive Transducer (arXiv 2003.07705) from pruned joiner output, as k2.

    The blank is a Bernoulli variable with logit ``logits[..., 0]``; the
    non-blank symbols share the remaining probability by a softmax over
    ``logits[..., 1:]``:

    ``py = log sigmoid(logits[..., 0])``,
    ``px = logits[..., sym] - logsumexp(logits[..., 1:]) + log(1 - sigmoid(logits[..., 0]))``.

    Args:
      logits: ``(B, T, R, C)``; symbols: ``(B, S)`` int64 in ``[1, C)``;
      ranges: ``(B, T, R)`` int64 in ``[0, S]``;
      termination_symbol: must be 0 (the blank is the first logit);
      boundary: ``(B, 4)`` or None; rnnt_type: as :func:`get_rnnt_logprobs_pruned`.
    Returns:
      ``px`` ``(B, S, T+1)`` (regular) or ``(B, S, T)``, ``py`` ``(B, S+1, T)``.
    """
    if termination_symbol != 0:
        raise ValueError(f"the HAT loss needs termination_symbol 0, got {termination_symbol}")
    B, T, R, C, S = _check_pruned(logits, symbols, ranges, termination_symbol)
    check_rnnt_type(rnnt_type, S, T, boundary)
    ranges = ranges.to(torch.int64)
    blank_logit = logits[..., 0]
    py_win = torch.nn.functional.logsigmoid(blank_logit)  # (B, T, R)
    non_blank_shift = py_win - blank_logit - torch.logsumexp(logits[..., 1:], dim=3)  # log(1 - sigmoid) - lse
    sym = _window_symbols(symbols, ranges, termination_symbol)
    px_win = torch.gather(logits, 3, sym.unsqueeze(3)).squeeze(3) + non_blank_shift
    return _unprune(px_win, py_win, ranges, S, rnnt_type, boundary)
