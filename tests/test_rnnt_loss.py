"""Tests of icefall_lite.nn.rnnt_loss against brute-force lattice loops.

The references below are written independently of the library: plain Python
loops over the RNN-T lattice (Graves' alpha recursion over (t, u)) and over
the (s, t) grid of the mutual-information recursion, in float64, with
gradients taken by torch autograd through those loops.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import pytest
import torch

from icefall_lite.nn.rnnt_loss import (
    do_rnnt_pruning,
    get_rnnt_prune_ranges,
    make_boundary,
    mutual_information_recursion,
    rnnt_loss_pruned,
    rnnt_loss_simple,
    rnnt_loss_smoothed,
    rnnt_loss_torchaudio,
)

Tensor = torch.Tensor
F64 = torch.float64
NEG_INF = float("-inf")
TOL = dict(atol=1e-6, rtol=1e-6)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --------------------------------------------------------------------------
# brute-force references
# --------------------------------------------------------------------------


def _lse(terms: List[Tensor]) -> Tensor:
    """log(sum(exp(terms))) over 0-d tensors, ignoring -inf terms."""
    kept = [x for x in terms if x.item() != NEG_INF]
    if not kept:
        return torch.tensor(NEG_INF, dtype=F64)
    return torch.logsumexp(torch.stack(kept), dim=0)


def ref_mi_score(px: Tensor, py: Tensor, s0: int, t0: int, s1: int, t1: int) -> Tensor:
    """p[s1, t1] of the recursion for one sequence; px (S, T+1), py (S+1, T)."""
    p = {(s0, t0): torch.zeros((), dtype=px.dtype)}
    for s in range(s0, s1 + 1):
        for t in range(t0, t1 + 1):
            if (s, t) == (s0, t0):
                continue
            terms = []
            if s > s0:
                terms.append(p[(s - 1, t)] + px[s - 1, t])
            if t > t0:
                terms.append(p[(s, t - 1)] + py[s, t - 1])
            p[(s, t)] = _lse(terms)
    return p[(s1, t1)]


LogProbFn = Callable[[int, int], Optional[Tensor]]


def ref_rnnt_nll(logp: LogProbFn, y: List[int], T_b: int, U_b: int, blank: int) -> Tensor:
    """-log P(y | x) by Graves' forward recursion.

    logp(t, u) is the (V,) log-distribution at frame t after u symbols, or
    None when that node is pruned away.
    """
    alpha = {(0, 0): torch.zeros((), dtype=F64)}
    for t in range(T_b):
        for u in range(U_b + 1):
            if (t, u) == (0, 0):
                continue
            terms = []
            if t > 0 and logp(t - 1, u) is not None:
                terms.append(alpha[(t - 1, u)] + logp(t - 1, u)[blank])
            if u > 0 and logp(t, u - 1) is not None:
                terms.append(alpha[(t, u - 1)] + logp(t, u - 1)[y[u - 1]])
            alpha[(t, u)] = _lse(terms)
    final = logp(T_b - 1, U_b)
    if final is None:
        return torch.tensor(math.inf, dtype=F64)
    return -(alpha[(T_b - 1, U_b)] + final[blank])


# --------------------------------------------------------------------------
# random cases
# --------------------------------------------------------------------------

# (T_b, U_b) per sequence; max T = 7, max U = 4.  Includes U_b = 0, U_b = U,
# T_b < T, and T_b = T.
LENGTHS = [(7, 2), (5, 4), (7, 4), (4, 0)]
T_MAX, U_MAX, C = 7, 4, 6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _lengths(device: str = "cpu") -> Tuple[Tensor, Tensor]:
    frames = torch.tensor([t for t, _ in LENGTHS], device=device)
    syms = torch.tensor([u for _, u in LENGTHS], device=device)
    return frames, syms


def _lm_am(seed: int, dtype=F64) -> Tuple[Tensor, Tensor, Tensor]:
    g = _gen(seed)
    B = len(LENGTHS)
    lm = torch.randn(B, U_MAX + 1, C, generator=g, dtype=F64).to(dtype)
    am = torch.randn(B, T_MAX, C, generator=g, dtype=F64).to(dtype)
    symbols = torch.randint(1, C, (B, U_MAX), generator=g)
    return lm, am, symbols


def _boundary() -> Tensor:
    frames, syms = _lengths()
    return make_boundary(syms, frames)


def _weights(B: int, seed: int = 123) -> Tensor:
    """Random positive per-sequence weights, so each sequence's grad is checked."""
    return torch.rand(B, generator=_gen(seed), dtype=F64) + 0.5


# --------------------------------------------------------------------------
# mutual_information_recursion
# --------------------------------------------------------------------------


def test_mi_scores_and_posteriors_match_reference():
    g = _gen(0)
    B, S, T = 4, 4, 6
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64, requires_grad=True)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64, requires_grad=True)
    boundary = torch.tensor([[0, 0, 4, 6], [0, 0, 2, 6], [0, 0, 4, 3], [0, 0, 0, 2]])

    scores, (px_post, py_post) = mutual_information_recursion(px, py, boundary, return_grad=True)
    assert scores.shape == (B,)
    assert px_post.shape == px.shape and py_post.shape == py.shape
    w = _weights(B)
    (scores * w).sum().backward()

    for b in range(B):
        pxb = px[b].detach().clone().requires_grad_()
        pyb = py[b].detach().clone().requires_grad_()
        s0, t0, s1, t1 = boundary[b].tolist()
        ref = ref_mi_score(pxb, pyb, s0, t0, s1, t1)
        gx, gy = torch.autograd.grad(ref, [pxb, pyb], allow_unused=True)
        gx = torch.zeros_like(pxb) if gx is None else gx
        gy = torch.zeros_like(pyb) if gy is None else gy
        torch.testing.assert_close(scores[b].detach(), ref.detach(), **TOL)
        torch.testing.assert_close(px_post[b], gx, **TOL)
        torch.testing.assert_close(py_post[b], gy, **TOL)
        torch.testing.assert_close(px.grad[b], w[b] * gx, **TOL)
        torch.testing.assert_close(py.grad[b], w[b] * gy, **TOL)
    # arcs outside each sequence's rectangle have zero posterior
    assert px_post[2, :, 4:].abs().max() == 0 and py_post[1, 3:].abs().max() == 0


def test_mi_nonzero_begin_matches_reference():
    g = _gen(1)
    B, S, T = 3, 4, 5
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    boundary = torch.tensor([[1, 2, 4, 5], [0, 3, 3, 4], [2, 0, 2, 5]])
    scores, (px_post, py_post) = mutual_information_recursion(px, py, boundary, return_grad=True)
    for b in range(B):
        pxb = px[b].clone().requires_grad_()
        pyb = py[b].clone().requires_grad_()
        ref = ref_mi_score(pxb, pyb, *boundary[b].tolist())
        gx, gy = torch.autograd.grad(ref, [pxb, pyb], allow_unused=True)
        gx = torch.zeros_like(pxb) if gx is None else gx
        gy = torch.zeros_like(pyb) if gy is None else gy
        torch.testing.assert_close(scores[b], ref.detach(), **TOL)
        torch.testing.assert_close(px_post[b], gx, **TOL)
        torch.testing.assert_close(py_post[b], gy, **TOL)


def test_mi_gradcheck():
    g = _gen(2)
    B, S, T = 2, 3, 4
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64, requires_grad=True)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64, requires_grad=True)
    boundary = torch.tensor([[0, 0, 3, 4], [0, 0, 2, 3]])
    assert torch.autograd.gradcheck(lambda a, b: mutual_information_recursion(a, b, boundary), (px, py))
    assert torch.autograd.gradcheck(lambda a, b: mutual_information_recursion(a, b), (px, py))


def test_mi_neg_inf_is_safe():
    g = _gen(3)
    B, S, T = 3, 3, 4
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    px[:, :, T] = NEG_INF  # RNN-T style last column
    px[0, 1, 2] = NEG_INF  # a few blocked arcs; sequence 0 still possible
    py[0, 0, 1] = NEG_INF
    py[1] = NEG_INF  # sequence 1: no frame can be consumed -> impossible
    px[2, :, :2] = NEG_INF  # sequence 2: symbols only from frame 2
    px.requires_grad_()
    py.requires_grad_()

    scores, (px_post, py_post) = mutual_information_recursion(px, py, return_grad=True)
    assert scores[1].item() == NEG_INF
    assert torch.isfinite(scores[[0, 2]]).all()
    assert not torch.isnan(px_post).any() and not torch.isnan(py_post).any()
    assert px_post[1].abs().max() == 0 and py_post[1].abs().max() == 0
    assert px_post[0, 1, 2] == 0 and py_post[0, 0, 1] == 0 and px_post[:, :, T].abs().max() == 0

    scores.sum().backward()  # the -inf score must not poison gradients
    assert torch.isfinite(px.grad).all() and torch.isfinite(py.grad).all()
    for b in (0, 2):
        pxb = px[b].detach().clone().requires_grad_()
        pyb = py[b].detach().clone().requires_grad_()
        ref = ref_mi_score(pxb, pyb, 0, 0, S, T)
        gx, gy = torch.autograd.grad(ref, [pxb, pyb])
        torch.testing.assert_close(scores[b].detach(), ref.detach(), **TOL)
        torch.testing.assert_close(px_post[b], gx, **TOL)
        torch.testing.assert_close(py_post[b], gy, **TOL)


def test_mi_float32_matches_float64():
    g = _gen(4)
    B, S, T = 3, 10, 30
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    boundary = torch.tensor([[0, 0, 10, 30], [0, 0, 7, 22], [0, 0, 3, 30]])
    s64, (gx64, gy64) = mutual_information_recursion(px, py, boundary, return_grad=True)
    s32, (gx32, gy32) = mutual_information_recursion(px.float(), py.float(), boundary, return_grad=True)
    assert s32.dtype == torch.float32 and gx32.dtype == torch.float32
    torch.testing.assert_close(s32.double(), s64, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(gx32.double(), gx64, atol=1e-4, rtol=0)
    torch.testing.assert_close(gy32.double(), gy64, atol=1e-4, rtol=0)


def test_mi_rejects_bad_shapes_and_boundaries():
    px = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError):
        mutual_information_recursion(px, torch.zeros(2, 3, 4))  # py needs S+1 rows
    with pytest.raises(ValueError):
        mutual_information_recursion(px, torch.zeros(2, 4, 4), torch.tensor([[0, 0, 4, 4], [0, 0, 1, 1]]))


# --------------------------------------------------------------------------
# full rnnt_loss
# --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("logsumexp_chunk", [None, 3 * C + 2])
def test_rnnt_loss_matches_reference(device, logsumexp_chunk, monkeypatch):
    # logsumexp_chunk: the normalisers are taken over chunks of rows that do
    # not divide the 4 * 7 * 5 lattice cells (3 cells and 2 elements per chunk).
    if logsumexp_chunk is not None:
        monkeypatch.setattr("icefall_lite.nn.rnnt_logprobs._LOGSUMEXP_CHUNK_ELEMENTS", logsumexp_chunk)
    g = _gen(5)
    B, V, blank = len(LENGTHS), C, 2
    frames, syms = _lengths()
    logits = torch.randn(B, T_MAX, U_MAX + 1, V, generator=g, dtype=F64)
    targets = torch.randint(0, V - 1, (B, U_MAX), generator=g)
    targets[targets >= blank] += 1  # never blank
    for b, (_, u) in enumerate(LENGTHS):
        targets[b, u:] = -1 if b % 2 else 999  # padding (any value) must be ignored

    x = logits.clone().to(device).requires_grad_()
    loss = rnnt_loss_torchaudio(
        x, targets.to(device), frames.to(device), syms.to(device), blank=blank, reduction="none"
    )
    w = _weights(B)
    (loss * w.to(device)).sum().backward()
    grad = x.grad.cpu()

    ref_logits = logits.clone().requires_grad_()
    refs = []
    for b, (T_b, U_b) in enumerate(LENGTHS):
        lp = ref_logits[b].log_softmax(dim=-1)
        refs.append(ref_rnnt_nll(lambda t, u: lp[t, u], targets[b].tolist(), T_b, U_b, blank))
    ref = torch.stack(refs)
    (ref * w).sum().backward()

    torch.testing.assert_close(loss.detach().cpu(), ref.detach(), **TOL)
    torch.testing.assert_close(grad, ref_logits.grad, **TOL)
    # padded frames and symbol positions receive no gradient
    assert grad[1, 5:].abs().max() == 0 and grad[0, :, 3:].abs().max() == 0


def test_rnnt_loss_reductions():
    g = _gen(6)
    B = len(LENGTHS)
    frames, syms = _lengths()
    logits = torch.randn(B, T_MAX, U_MAX + 1, C, generator=g, dtype=F64)
    targets = torch.randint(1, C, (B, U_MAX), generator=g)
    none = rnnt_loss_torchaudio(logits, targets, frames, syms, reduction="none")
    assert none.shape == (B,)
    torch.testing.assert_close(rnnt_loss_torchaudio(logits, targets, frames, syms, reduction="sum"), none.sum())
    torch.testing.assert_close(rnnt_loss_torchaudio(logits, targets, frames, syms, reduction="mean"), none.sum() / B)
    torch.testing.assert_close(rnnt_loss_torchaudio(logits, targets, frames, syms), none.sum() / B)  # default mean
    with pytest.raises(ValueError):
        rnnt_loss_torchaudio(logits, targets, frames, syms, reduction="batchmean")


# --------------------------------------------------------------------------
# simple / smoothed
# --------------------------------------------------------------------------


def test_rnnt_loss_simple_matches_reference():
    lm, am, symbols = _lm_am(7)
    boundary = _boundary()
    lm.requires_grad_()
    am.requires_grad_()
    loss = rnnt_loss_simple(lm, am, symbols, 0, boundary, reduction="none")
    w = _weights(len(LENGTHS))
    lm_g, am_g = torch.autograd.grad((loss * w).sum(), [lm, am])

    lm_r = lm.detach().clone().requires_grad_()
    am_r = am.detach().clone().requires_grad_()
    refs = []
    for b, (T_b, U_b) in enumerate(LENGTHS):

        def lp(t, u, b=b):
            return (lm_r[b, u] + am_r[b, t]).log_softmax(-1)

        refs.append(ref_rnnt_nll(lp, symbols[b].tolist(), T_b, U_b, 0))
    ref = torch.stack(refs)
    lm_rg, am_rg = torch.autograd.grad((ref * w).sum(), [lm_r, am_r])
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(lm_g, lm_rg, **TOL)
    torch.testing.assert_close(am_g, am_rg, **TOL)


def test_rnnt_loss_simple_equals_full_loss_on_additive_logits():
    lm, am, symbols = _lm_am(8)
    lm = lm * 3  # wider range to exercise the max-subtract trick
    frames, syms = _lengths()
    boundary = make_boundary(syms, frames)
    simple, (px_post, py_post) = rnnt_loss_simple(lm, am, symbols, 0, boundary, reduction="none", return_grad=True)
    full = rnnt_loss_torchaudio(lm[:, None] + am[:, :, None], symbols, frames, syms, blank=0, reduction="none")
    torch.testing.assert_close(simple, full, **TOL)
    # posteriors: each sequence's blank arcs carry total mass T_b, symbol arcs U_b
    torch.testing.assert_close(py_post.sum(dim=(1, 2)), frames.to(F64), **TOL)
    torch.testing.assert_close(px_post.sum(dim=(1, 2)), syms.to(F64), **TOL)


def test_simple_and_smoothed_are_invariant_to_row_shifts():
    # log_softmax(lm[s] + a + am[t] + b) does not depend on per-row constants;
    # shifts of 1000 overflow exp() unless the max-subtraction trick is used.
    lm, am, symbols = _lm_am(18)
    boundary = _boundary()
    g = _gen(19)
    lm_shift = lm + 1000 * torch.rand(lm.shape[0], lm.shape[1], 1, generator=g, dtype=F64)
    am_shift = am - 1000 * torch.rand(am.shape[0], am.shape[1], 1, generator=g, dtype=F64)
    for fn in (rnnt_loss_simple, rnnt_loss_smoothed):
        base = fn(lm, am, symbols, 0, boundary=boundary, reduction="none")
        shifted = fn(lm_shift, am_shift, symbols, 0, boundary=boundary, reduction="none")
        torch.testing.assert_close(shifted, base, atol=1e-8, rtol=1e-8)


def _ref_smoothed(lm: Tensor, am: Tensor, symbols: Tensor, lm_scale: float, am_scale: float) -> Tensor:
    """Per-cell interpolated log-scores, then Graves' recursion; (B,) losses."""
    # unigram LM: softmax(lm) averaged over every (b, s) row, padding included
    rows = [lm[b, s].softmax(-1) for b in range(lm.shape[0]) for s in range(lm.shape[1])]
    log_unigram = torch.stack(rows).mean(0).log()
    c = 1.0 - lm_scale - am_scale
    refs = []
    for b, (T_b, U_b) in enumerate(LENGTHS):

        def lp(t, u, b=b):
            joint = (lm[b, u] + am[b, t]).log_softmax(-1)
            lm_only = lm[b, u].log_softmax(-1)
            am_only = (am[b, t] + log_unigram).log_softmax(-1)
            return c * joint + lm_scale * lm_only + am_scale * am_only

        refs.append(ref_rnnt_nll(lp, symbols[b].tolist(), T_b, U_b, 0))
    return torch.stack(refs)


@pytest.mark.parametrize("lm_scale, am_scale", [(0.2, 0.15), (0.25, 0.0), (0.0, 0.15)])
def test_rnnt_loss_smoothed_matches_reference(lm_scale, am_scale):
    """Both smoothing terms, and each alone (a zero-scale term is left out of the computation)."""
    lm, am, symbols = _lm_am(9)
    boundary = _boundary()
    lm.requires_grad_()
    am.requires_grad_()
    loss = rnnt_loss_smoothed(lm, am, symbols, 0, lm_scale, am_scale, boundary, reduction="none")
    w = _weights(len(LENGTHS))
    lm_g, am_g = torch.autograd.grad((loss * w).sum(), [lm, am])

    lm_r = lm.detach().clone().requires_grad_()
    am_r = am.detach().clone().requires_grad_()
    ref = _ref_smoothed(lm_r, am_r, symbols, lm_scale, am_scale)
    lm_rg, am_rg = torch.autograd.grad((ref * w).sum(), [lm_r, am_r])
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(lm_g, lm_rg, **TOL)
    torch.testing.assert_close(am_g, am_rg, **TOL)


def test_rnnt_loss_smoothed_with_zero_scales_equals_simple():
    lm, am, symbols = _lm_am(10)
    boundary = _boundary()
    lm.requires_grad_()
    am.requires_grad_()
    sm, (sx, sy) = rnnt_loss_smoothed(lm, am, symbols, 0, 0.0, 0.0, boundary, return_grad=True)
    sg = torch.autograd.grad(sm, [lm, am])
    si, (ix, iy) = rnnt_loss_simple(lm, am, symbols, 0, boundary, return_grad=True)
    ig = torch.autograd.grad(si, [lm, am])
    torch.testing.assert_close(sm, si, **TOL)
    torch.testing.assert_close(sx, ix, **TOL)
    torch.testing.assert_close(sy, iy, **TOL)
    for a, b in zip(sg, ig):
        torch.testing.assert_close(a, b, **TOL)
    # and non-zero scales do change it
    assert not torch.allclose(rnnt_loss_smoothed(lm, am, symbols, 0, 0.1, 0.1, boundary), si)


def test_simple_and_smoothed_reductions():
    lm, am, symbols = _lm_am(11)
    boundary = _boundary()
    B = lm.shape[0]
    for fn in (rnnt_loss_simple, rnnt_loss_smoothed):
        none = fn(lm, am, symbols, 0, boundary=boundary, reduction="none")
        assert none.shape == (B,)
        torch.testing.assert_close(fn(lm, am, symbols, 0, boundary=boundary, reduction="sum"), none.sum())
        torch.testing.assert_close(fn(lm, am, symbols, 0, boundary=boundary, reduction="mean"), none.sum() / B)
        loss, (gx, gy) = fn(lm, am, symbols, 0, boundary=boundary, reduction="sum", return_grad=True)
        torch.testing.assert_close(loss, none.sum())
        assert gx.shape == (B, U_MAX, T_MAX + 1) and gy.shape == (B, U_MAX + 1, T_MAX)
        with pytest.raises(ValueError):
            fn(lm, am, symbols, 0, boundary=boundary, reduction="avg")


# --------------------------------------------------------------------------
# pruning
# --------------------------------------------------------------------------


def _joiner_case(seed: int, dtype=F64, D: int = 5):
    """am (B,T,D), lm (B,S+1,D), W (D,C): joiner(a, l) = tanh(a + l) @ W."""
    g = _gen(seed)
    B = len(LENGTHS)
    am = torch.randn(B, T_MAX, D, generator=g, dtype=F64).to(dtype)
    lm = torch.randn(B, U_MAX + 1, D, generator=g, dtype=F64).to(dtype)
    W = (torch.randn(D, C, generator=g, dtype=F64) * 2).to(dtype)
    symbols = torch.randint(1, C, (B, U_MAX), generator=g)
    return am, lm, W, symbols


def _joiner(a: Tensor, lm_out: Tensor, W: Tensor) -> Tensor:
    return torch.tanh(a + lm_out) @ W


def test_pruned_loss_with_full_range_equals_full_loss():
    am, lm, W, symbols = _joiner_case(12)
    frames, syms = _lengths()
    boundary = make_boundary(syms, frames)
    B, T, S1 = am.shape[0], am.shape[1], lm.shape[1]
    ranges = torch.arange(S1).expand(B, T, S1).contiguous()

    params = [p.clone().requires_grad_() for p in (am, lm, W)]
    am_p, lm_p = do_rnnt_pruning(params[0], params[1], ranges)
    pruned = rnnt_loss_pruned(_joiner(am_p, lm_p, params[2]), symbols, ranges, 0, boundary, reduction="none")
    w = _weights(B)
    g_pruned = torch.autograd.grad((pruned * w).sum(), params)

    params2 = [p.clone().requires_grad_() for p in (am, lm, W)]
    full_logits = _joiner(params2[0][:, :, None], params2[1][:, None], params2[2])
    full = rnnt_loss_torchaudio(full_logits, symbols, frames, syms, reduction="none")
    g_full = torch.autograd.grad((full * w).sum(), params2)

    torch.testing.assert_close(pruned.detach(), full.detach(), **TOL)
    for a, b in zip(g_pruned, g_full):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("s_range", [2, 3])
def test_pruned_loss_matches_pruned_reference(s_range):
    am, lm, W, symbols = _joiner_case(13)
    frames, syms = _lengths()
    boundary = make_boundary(syms, frames)
    # pruning bounds from the simple loss on projections of am / lm
    _, (px_post, py_post) = rnnt_loss_simple(lm @ W, am @ W, symbols, 0, boundary, return_grad=True)
    ranges = get_rnnt_prune_ranges(px_post, py_post, boundary, s_range)
    assert ranges.shape == (len(LENGTHS), T_MAX, s_range)

    params = [p.clone().requires_grad_() for p in (am, lm, W)]
    am_p, lm_p = do_rnnt_pruning(params[0], params[1], ranges)
    loss = rnnt_loss_pruned(_joiner(am_p, lm_p, params[2]), symbols, ranges, 0, boundary, reduction="none")
    w = _weights(len(LENGTHS))
    grads = torch.autograd.grad((loss * w).sum(), params)

    params_r = [p.clone().requires_grad_() for p in (am, lm, W)]
    refs, fulls = [], []
    for b, (T_b, U_b) in enumerate(LENGTHS):
        window = [set(ranges[b, t].tolist()) for t in range(T_MAX)]

        def lp_pruned(t, u, b=b, window=window):
            if u not in window[t]:
                return None
            return _joiner(params_r[0][b, t], params_r[1][b, u], params_r[2]).log_softmax(-1)

        def lp_full(t, u, b=b):
            return _joiner(am[b, t], lm[b, u], W).log_softmax(-1)

        refs.append(ref_rnnt_nll(lp_pruned, symbols[b].tolist(), T_b, U_b, 0))
        fulls.append(ref_rnnt_nll(lp_full, symbols[b].tolist(), T_b, U_b, 0))
    ref = torch.stack(refs)
    grads_r = torch.autograd.grad((ref * w).sum(), params_r)

    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a, b, **TOL)
    # pruning removes paths, so it can only increase the loss
    assert (loss.detach() >= torch.stack(fulls) - 1e-9).all()


def _check_range_invariants(ranges: Tensor, boundary: Tensor, S: int, R: int) -> None:
    B, T, R_out = ranges.shape
    assert R_out == R
    assert ranges.dtype == torch.int64
    s0 = ranges[:, :, 0]
    torch.testing.assert_close(ranges, s0.unsqueeze(2) + torch.arange(R))
    assert (ranges >= 0).all() and (ranges <= S).all()
    assert (s0[:, 0] == 0).all()
    step = s0[:, 1:] - s0[:, :-1]
    assert (step >= 0).all() and (step <= R - 1).all()
    for b in range(B):
        U_b, T_b = boundary[b, 2].item(), boundary[b, 3].item()
        last = max(U_b - R + 1, 0)
        assert (s0[b] <= last).all()  # windows never pass U_b (unless R > U_b + 1)
        assert (ranges[b] <= max(U_b, R - 1)).all()
        assert (s0[b, T_b - 1 :] == last).all()  # last frame rule (and padding frames)


@pytest.mark.parametrize("s_range", [2, 3, 5, 40])
def test_prune_ranges_invariants(s_range):
    g = _gen(14)
    B, T, S = 6, 12, 7
    lm = torch.randn(B, S + 1, C, generator=g, dtype=F64) * 2
    am = torch.randn(B, T, C, generator=g, dtype=F64) * 2
    symbols = torch.randint(1, C, (B, S), generator=g)
    frames = torch.tensor([12, 9, 12, 4, 7, 10])
    syms = torch.tensor([7, 5, 2, 7, 0, 6])
    boundary = make_boundary(syms, frames)
    loss, (px_post, py_post) = rnnt_loss_simple(lm, am, symbols, 0, boundary, return_grad=True)
    ranges = get_rnnt_prune_ranges(px_post, py_post, boundary, s_range)
    # seq 3 has T_b = 4 frames for U_b = 7 symbols: needs R >= ceil(7/4)+1 = 3
    R = min(max(s_range, 3), S + 1)
    _check_range_invariants(ranges, boundary, S, R)

    am_p, lm_p = do_rnnt_pruning(am, lm, ranges)
    pruned = rnnt_loss_pruned(am_p + lm_p, symbols, ranges, 0, boundary, reduction="none")
    full = rnnt_loss_simple(lm, am, symbols, 0, boundary, reduction="none")
    assert torch.isfinite(pruned).all()  # a path always survives pruning
    assert (pruned >= full - 1e-9).all()
    if R == S + 1:
        torch.testing.assert_close(pruned, full, **TOL)


def _ref_prune_starts(px_post: Tensor, py_post: Tensor, U_b: int, T_b: int, R: int) -> List[int]:
    """Window starts for one sequence by explicit loops (paper section 3.2)."""
    S = px_post.shape[0]
    T = py_post.shape[1]
    starts = []
    for t in range(T):
        if t >= T_b - 1:
            starts.append(max(U_b - R + 1, 0))
            continue
        best, best_s0 = None, 0
        for s0 in range(S + 2 - R):
            mass = sum(py_post[s0 + k, t].item() for k in range(R))
            mass -= px_post[s0 - 1, t].item() if s0 > 0 else 0.0
            if best is None or mass > best:
                best, best_s0 = mass, s0
        starts.append(best_s0)
    for t in range(T - 2, -1, -1):  # non-decreasing: lower earlier frames
        starts[t] = min(starts[t], starts[t + 1])
    for t in range(T - 2, -1, -1):  # no jump of R or more: raise earlier frames
        starts[t] = max(starts[t], starts[t + 1] - (R - 1))
    return [min(s0, t * (R - 1)) for t, s0 in enumerate(starts)]  # start at 0


@pytest.mark.parametrize("s_range", [2, 3, 4])
def test_prune_ranges_match_loop_reference(s_range):
    g = _gen(20)
    B, T, S = 5, 10, 6
    lm = torch.randn(B, S + 1, C, generator=g, dtype=F64)
    am = torch.randn(B, T, C, generator=g, dtype=F64)
    symbols = torch.randint(1, C, (B, S), generator=g)
    frames = torch.tensor([10, 8, 10, 6, 9])
    syms = torch.tensor([6, 6, 3, 4, 1])
    boundary = make_boundary(syms, frames)
    _, (px_post, py_post) = rnnt_loss_simple(lm, am, symbols, 0, boundary, return_grad=True)
    # also arbitrary non-negative "posteriors": their argmax jumps back and forth,
    # which exercises every adjustment step
    px_rand = torch.rand(B, S, T + 1, generator=g, dtype=F64)
    py_rand = torch.rand(B, S + 1, T, generator=g, dtype=F64)
    for gx, gy in ((px_post, py_post), (px_rand, py_rand)):
        ranges = get_rnnt_prune_ranges(gx, gy, boundary, s_range)
        for b in range(B):
            ref = _ref_prune_starts(gx[b], gy[b], syms[b].item(), frames[b].item(), s_range)
            assert ranges[b, :, 0].tolist() == ref, b
        _check_range_invariants(ranges, boundary, S, s_range)


def test_prune_ranges_follow_a_dominant_alignment():
    # One alignment carries (almost) all the posterior mass; the window at each
    # frame must then start at max(b_t - R + 1, 0), b_t = symbols emitted by
    # the end of frame t (the cell the blank leaves frame t from).
    S, T, R = 6, 8, 3
    emitted = [[1, 2], [3], [], [4, 5], [], [6], []]  # per frame t < 7; T_b = 7
    T_b = len(emitted)
    px = torch.full((1, S, T + 1), -30.0, dtype=F64)
    py = torch.full((1, S + 1, T), -30.0, dtype=F64)
    s = 0
    b_t = []
    for t, syms_t in enumerate(emitted):
        for _ in syms_t:
            px[0, s, t] = 0.0
            s += 1
        py[0, s, t] = 0.0
        b_t.append(s)
    px[:, :, T] = NEG_INF
    boundary = torch.tensor([[0, 0, S, T_b]])
    _, (px_post, py_post) = mutual_information_recursion(px, py, boundary, return_grad=True)
    ranges = get_rnnt_prune_ranges(px_post, py_post, boundary, R)
    expected = [max(b_t[min(t, T_b - 1)] - R + 1, 0) for t in range(T)]
    assert ranges[0, :, 0].tolist() == expected
    _check_range_invariants(ranges, boundary, S, R)


def test_do_rnnt_pruning_gathers_rows():
    g = _gen(15)
    B, T, S, Da, Dl, R = 2, 5, 4, 3, 6, 2
    am = torch.randn(B, T, Da, generator=g)
    lm = torch.randn(B, S + 1, Dl, generator=g)
    ranges = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 1, 1, 3]]).unsqueeze(2) + torch.arange(R)
    am_p, lm_p = do_rnnt_pruning(am, lm, ranges)
    assert am_p.shape == (B, T, R, Da) and lm_p.shape == (B, T, R, Dl)
    for b in range(B):
        for t in range(T):
            for r in range(R):
                assert torch.equal(am_p[b, t, r], am[b, t])
                assert torch.equal(lm_p[b, t, r], lm[b, ranges[b, t, r]])


def test_pruned_loss_reductions():
    am, lm, W, symbols = _joiner_case(16)
    boundary = _boundary()
    B, T, S1 = am.shape[0], am.shape[1], lm.shape[1]
    ranges = torch.arange(S1).expand(B, T, S1).contiguous()
    logits = _joiner(*do_rnnt_pruning(am, lm, ranges), W)
    none = rnnt_loss_pruned(logits, symbols, ranges, 0, boundary, reduction="none")
    assert none.shape == (B,)
    torch.testing.assert_close(rnnt_loss_pruned(logits, symbols, ranges, 0, boundary, reduction="sum"), none.sum())
    torch.testing.assert_close(rnnt_loss_pruned(logits, symbols, ranges, 0, boundary), none.sum() / B)


# --------------------------------------------------------------------------
# dtype agreement and helpers
# --------------------------------------------------------------------------


def test_float32_agrees_with_float64():
    am, lm, W, symbols = _joiner_case(17)
    frames, syms = _lengths()
    boundary = make_boundary(syms, frames)

    def all_losses(dtype):
        a = am.to(dtype).requires_grad_()
        lm_in = lm.to(dtype).requires_grad_()
        Wd = W.to(dtype)
        out = {}
        out["simple"] = rnnt_loss_simple(lm_in @ Wd, a @ Wd, symbols, 0, boundary, reduction="none")
        out["smoothed"] = rnnt_loss_smoothed(lm_in @ Wd, a @ Wd, symbols, 0, 0.25, 0.1, boundary, reduction="none")
        out["full"] = rnnt_loss_torchaudio(
            _joiner(a[:, :, None], lm_in[:, None], Wd), symbols, frames, syms, reduction="none"
        )
        _, (gx, gy) = rnnt_loss_simple(lm_in @ Wd, a @ Wd, symbols, 0, boundary, return_grad=True)
        ranges = get_rnnt_prune_ranges(gx.double(), gy.double(), boundary, 3)
        out["pruned"] = rnnt_loss_pruned(
            _joiner(*do_rnnt_pruning(a, lm_in, ranges), Wd), symbols, ranges, 0, boundary, reduction="none"
        )
        total = sum(v.sum() for v in out.values())
        ga, gl = torch.autograd.grad(total, [a, lm_in])
        return {k: v.detach().double() for k, v in out.items()}, ga.double(), gl.double()

    l64, ga64, gl64 = all_losses(F64)
    l32, ga32, gl32 = all_losses(torch.float32)
    for k in l64:
        torch.testing.assert_close(l32[k], l64[k], atol=1e-4, rtol=1e-5, msg=k)
    torch.testing.assert_close(ga32, ga64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gl32, gl64, atol=1e-4, rtol=1e-4)


def test_make_boundary():
    b = make_boundary(torch.tensor([3, 0, 5], dtype=torch.int32), torch.tensor([10, 4, 7]))
    assert b.dtype == torch.int64
    assert b.tolist() == [[0, 0, 3, 10], [0, 0, 0, 4], [0, 0, 5, 7]]
    with pytest.raises(ValueError):
        make_boundary(torch.tensor([1, 2]), torch.tensor([3]))


def test_recursion_runs_two_tensor_ops_per_diagonal_step():
    """Forward and backward recursions share each step: one add and one logaddexp per diagonal
    (each a kernel launch on a GPU), plus a fixed number of ops around the loop."""
    from benchmarks.bench_recursion import OpCounter, forward_backward, make_inputs
    from icefall_lite.nn import mutual_information

    def ops(symbols: int, frames: int) -> int:
        px, py, _ = make_inputs(2, symbols, frames, torch.device("cpu"))
        boundary = mutual_information.make_boundary(torch.tensor([symbols] * 2), torch.tensor([frames] * 2))
        with OpCounter() as counter:
            forward_backward(mutual_information, px, py, boundary)
        return counter.count

    small, large = ops(4, 10), ops(24, 70)  # 15 and 95 diagonals
    assert (large - small) / (95 - 15) == pytest.approx(2.0, abs=0.05)
