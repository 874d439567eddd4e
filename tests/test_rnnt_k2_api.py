"""k2's API of icefall_lite.nn.rnnt_loss, tested against brute-force references.

The references are written independently of the library, in float64:

- :func:`enumerate_paths`: every monotone path through a small lattice, listed
  explicitly; scores and arc occupancies are sums over that list (no
  recursion at all).
- :func:`ref_transducer_nll`: the transducer forward recursion over frames and
  emitted symbols for each of k2's ``rnnt_type`` (regular, modified,
  constrained), with an optional delay penalty, on per-cell log-distributions;
  gradients are taken by autograd through the loop.

Covered: ``rnnt_type`` for every loss, ``delay_penalty``, ``reduction``,
``return_grad``, ``boundary`` (including non-zero begin corners), the HAT
variant of the pruned loss, both ways of choosing pruning windows,
``joint_mutual_information_recursion``, float32 accuracy of the posteriors,
and the signatures (names, order, defaults) of k2's functions.
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Callable, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch

from icefall_lite.nn import mutual_information
from icefall_lite.nn import rnnt_loss as k2api
from icefall_lite.nn.rnnt_loss import (
    do_rnnt_pruning,
    get_rnnt_logprobs,
    get_rnnt_logprobs_joint,
    get_rnnt_prune_ranges,
    get_rnnt_prune_ranges_deprecated,
    joint_mutual_information_recursion,
    make_boundary,
    mutual_information_recursion,
    rnnt_loss,
    rnnt_loss_pruned,
    rnnt_loss_simple,
    rnnt_loss_smoothed,
    rnnt_loss_torchaudio,
)

Tensor = torch.Tensor
F64 = torch.float64
NEG_INF = float("-inf")
TOL = dict(atol=1e-10, rtol=1e-10)
RNNT_TYPES = ["regular", "modified", "constrained"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------
# reference 1: explicit path enumeration
# --------------------------------------------------------------------------

Arc = Tuple[str, int, int]  # ("x" or "y", s, t): the arc px[s, t] or py[s, t]


def enumerate_paths(s0: int, t0: int, s1: int, t1: int, modified: bool) -> List[List[Arc]]:
    """Every path from cell (s0, t0) to (s1, t1) as its list of arcs.

    Regular: an x arc goes (s, t) -> (s+1, t), a y arc (s, t) -> (s, t+1).
    Modified: an x arc goes (s, t) -> (s+1, t+1), a y arc (s, t) -> (s, t+1).
    """
    n_x = s1 - s0
    n_moves = (t1 - t0) if modified else (s1 - s0) + (t1 - t0)
    if n_x < 0 or n_moves < n_x:
        return []
    paths = []
    for x_positions in itertools.combinations(range(n_moves), n_x):
        s, t, arcs = s0, t0, []
        for i in range(n_moves):
            if i in x_positions:
                arcs.append(("x", s, t))
                s, t = s + 1, (t + 1 if modified else t)
            else:
                arcs.append(("y", s, t))
                t += 1
        paths.append(arcs)
    return paths


def ref_scores_and_occupancy(px: Tensor, py: Tensor, corners: List[int], modified: bool):
    """Total log-score and arc occupancies of one sequence by path enumeration.

    Args:
      px: ``(S, T+1)`` or ``(S, T)``; py: ``(S+1, T)``; corners: [s0, t0, s1, t1].
    Returns:
      (score as float, px occupancy like px, py occupancy like py).
    """
    paths = enumerate_paths(*corners, modified=modified)
    scores = [sum(float(px[s, t]) if k == "x" else float(py[s, t]) for k, s, t in p) for p in paths]
    gx, gy = torch.zeros_like(px), torch.zeros_like(py)
    finite = [sc for sc in scores if sc != NEG_INF]
    if not finite:
        return NEG_INF, gx, gy
    top = max(finite)
    total = top + math.log(sum(math.exp(sc - top) for sc in finite))
    for p, sc in zip(paths, scores):
        if sc == NEG_INF:
            continue
        w = math.exp(sc - total)
        for k, s, t in p:
            (gx if k == "x" else gy)[s, t] += w
    return total, gx, gy


# --------------------------------------------------------------------------
# reference 2: the transducer recursion over (frame, emitted symbols)
# --------------------------------------------------------------------------

LogProbFn = Callable[[int, int], Optional[Tensor]]


def _lse(terms: List[Tensor]) -> Tensor:
    kept = [x for x in terms if x.item() != NEG_INF]
    if not kept:
        return torch.tensor(NEG_INF, dtype=F64)
    return torch.logsumexp(torch.stack(kept), dim=0)


def ref_transducer_nll(
    logp: LogProbFn, y: List[int], T_b: int, U_b: int, blank: int, rnnt_type: str, delay: float = 0.0
) -> Tensor:
    """-log P(y) of one sequence under k2's definition of ``rnnt_type``.

    logp(t, u) is the (V,) log-distribution at frame t after u symbols, or
    None where that node is pruned away.  ``delay`` adds
    ``delay * ((T_b - 1) / 2 - t)`` to every symbol emitted on frame t.

    regular:     (t, u) -> (t, u+1) by y[u], (t, u) -> (t+1, u) by blank; the
                 sequence ends with a blank on the last frame.
    modified:    (t, u) -> (t+1, u+1) by y[u] (one symbol per frame),
                 (t, u) -> (t+1, u) by blank; ends at (T_b, U_b).
    constrained: as modified, but emitting y[u] on frame t also scores the
                 blank of the next context on that frame, logp(t, u+1)[blank].
    """

    def lp(t: int, u: int, k: int) -> Optional[Tensor]:
        dist = logp(t, u)
        return None if dist is None else dist[k]

    def sym(t: int, u: int) -> Optional[Tensor]:
        score = lp(t, u, y[u])
        if score is None:
            return None
        if rnnt_type == "constrained":
            nxt = lp(t, u + 1, blank)
            if nxt is None:
                return None
            score = score + nxt
        return score + delay * ((T_b - 1) / 2 - t)

    alpha: Dict[Tuple[int, int], Tensor] = {(0, 0): torch.zeros((), dtype=F64)}
    if rnnt_type == "regular":
        for t in range(T_b):
            for u in range(U_b + 1):
                if (t, u) == (0, 0):
                    continue
                terms = []
                if t > 0 and lp(t - 1, u, blank) is not None:
                    terms.append(alpha[(t - 1, u)] + lp(t - 1, u, blank))
                if u > 0 and sym(t, u - 1) is not None:
                    terms.append(alpha[(t, u - 1)] + sym(t, u - 1))
                alpha[(t, u)] = _lse(terms)
        final = lp(T_b - 1, U_b, blank)
        return torch.tensor(math.inf, dtype=F64) if final is None else -(alpha[(T_b - 1, U_b)] + final)
    for t in range(1, T_b + 1):
        for u in range(U_b + 1):
            terms = []
            if (t - 1, u) in alpha and lp(t - 1, u, blank) is not None:
                terms.append(alpha[(t - 1, u)] + lp(t - 1, u, blank))
            if u > 0 and (t - 1, u - 1) in alpha and sym(t - 1, u - 1) is not None:
                terms.append(alpha[(t - 1, u - 1)] + sym(t - 1, u - 1))
            alpha[(t, u)] = _lse(terms)
    return -alpha[(T_b, U_b)]


# --------------------------------------------------------------------------
# random cases
# --------------------------------------------------------------------------

# (T_b, U_b) per sequence, T_b >= U_b so every rnnt_type has paths; max T 6, max U 4.
LENGTHS = [(6, 2), (5, 4), (6, 4), (4, 0)]
T_MAX, U_MAX, C = 6, 4, 5


def _lengths() -> Tuple[Tensor, Tensor]:
    return torch.tensor([t for t, _ in LENGTHS]), torch.tensor([u for _, u in LENGTHS])


def _boundary() -> Tensor:
    frames, syms = _lengths()
    return make_boundary(syms, frames)


def _weights(B: int, seed: int = 123) -> Tensor:
    """Random positive per-sequence weights, so each sequence's gradient is checked."""
    return torch.rand(B, generator=_gen(seed), dtype=F64) + 0.5


def _lm_am(seed: int) -> Tuple[Tensor, Tensor, Tensor]:
    g = _gen(seed)
    B = len(LENGTHS)
    lm = torch.randn(B, U_MAX + 1, C, generator=g, dtype=F64)
    am = torch.randn(B, T_MAX, C, generator=g, dtype=F64)
    symbols = torch.randint(1, C, (B, U_MAX), generator=g)
    return lm, am, symbols


def _random_corners(g: torch.Generator, S: int, T: int, modified: bool) -> List[int]:
    """[s0, t0, s1, t1] with a path between them (t1 - t0 >= s1 - s0 when modified)."""
    while True:
        s0, s1 = sorted(torch.randint(0, S + 1, (2,), generator=g).tolist())
        t0, t1 = sorted(torch.randint(0, T + 1, (2,), generator=g).tolist())
        if not modified or t1 - t0 >= s1 - s0:
            return [s0, t0, s1, t1]


# --------------------------------------------------------------------------
# mutual_information_recursion, both lattices: the PyTorch recursion and the Triton kernel
# --------------------------------------------------------------------------


def _on_triton_device(px: Tensor, py: Tensor, boundary: Optional[Tensor] = None, return_grad: bool = False):
    """The recursion by the Triton kernel on the device it runs on here (CUDA, else the CPU in Triton's
    interpreter), its results back on the CPU (autograd flows through the copies)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on = None if boundary is None else boundary.to(device)
    with mock.patch.object(mutual_information, "BACKEND", "triton"):
        out = mutual_information_recursion(px.to(device), py.to(device), on, return_grad)
    if not return_grad:
        return out.cpu()
    return out[0].cpu(), (out[1][0].cpu(), out[1][1].cpu())


def _mi_implementations() -> list:
    """The PyTorch recursion, and the Triton kernel where Triton is installed (every Linux set-up: the
    requirements list it)."""
    found = [pytest.param(mutual_information_recursion, id="pytorch")]
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError:
        return found
    return found + [pytest.param(_on_triton_device, id="triton")]


MI = _mi_implementations()


@pytest.mark.parametrize("modified", [False, True])
@pytest.mark.parametrize("mi", MI)
def test_mi_matches_path_enumeration(modified, mi):
    g = _gen(0)
    B, S, T = 6, 3, 5
    px = torch.randn(B, S, T if modified else T + 1, generator=g, dtype=F64)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    boundary = torch.tensor([[0, 0, S, T]] + [_random_corners(g, S, T, modified) for _ in range(B - 1)])
    px.requires_grad_()
    py.requires_grad_()
    scores, (gx, gy) = mi(px, py, boundary, return_grad=True)
    w = _weights(B)
    (scores * w).sum().backward()
    for b in range(B):
        ref, rx, ry = ref_scores_and_occupancy(px[b].detach(), py[b].detach(), boundary[b].tolist(), modified)
        assert scores[b].item() == pytest.approx(ref, abs=1e-10, rel=1e-10)
        torch.testing.assert_close(gx[b], rx, **TOL)
        torch.testing.assert_close(gy[b], ry, **TOL)
        torch.testing.assert_close(px.grad[b], w[b] * rx, **TOL)
        torch.testing.assert_close(py.grad[b], w[b] * ry, **TOL)


@pytest.mark.parametrize("modified", [False, True])
@pytest.mark.parametrize("mi", MI)
def test_mi_default_boundary_and_blocked_arcs(modified, mi):
    g = _gen(1)
    B, S, T = 3, 3, 4
    px = torch.randn(B, S, T if modified else T + 1, generator=g, dtype=F64)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    px[0, 1, 1] = NEG_INF
    py[0, 0, 2] = NEG_INF
    py[1] = NEG_INF  # sequence 1: no path at all
    s_none, (gx_none, gy_none) = mi(px, py, None, return_grad=True)
    full = torch.tensor([[0, 0, S, T]] * B)
    s_full, (gx_full, gy_full) = mi(px, py, full, return_grad=True)
    torch.testing.assert_close(s_none, s_full, **TOL)
    torch.testing.assert_close(gx_none, gx_full, **TOL)
    torch.testing.assert_close(gy_none, gy_full, **TOL)
    assert s_none[1].item() == NEG_INF and gx_none[1].abs().max() == 0 and gy_none[1].abs().max() == 0
    for b in (0, 2):
        ref, rx, ry = ref_scores_and_occupancy(px[b], py[b], [0, 0, S, T], modified)
        assert s_none[b].item() == pytest.approx(ref, abs=1e-10, rel=1e-10)
        torch.testing.assert_close(gx_none[b], rx, **TOL)
        torch.testing.assert_close(gy_none[b], ry, **TOL)


@pytest.mark.parametrize("mi", MI)
def test_mi_float32_posteriors_are_accurate_on_long_lattices(mi):
    """Scores of ~1000 nats: the posteriors must not carry float32 rounding of the scores."""
    g = _gen(2)
    B, S, T = 4, 30, 150
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64).log_softmax(dim=1) * 3
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64).log_softmax(dim=1) * 3
    boundary = make_boundary(torch.tensor([30, 25, 18, 30]), torch.tensor([150, 120, 150, 90]))
    px = fix_boundary_column(px, boundary)
    s64, (gx64, gy64) = mi(px, py, boundary, return_grad=True)
    assert (s64 < -500).all()
    s32, (gx32, gy32) = mi(px.float(), py.float(), boundary, return_grad=True)
    assert gx32.dtype == torch.float32
    for got, want in ((gx32, gx64), (gy32, gy64)):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 1e-6, rel
    # each path crosses every frame once and emits every symbol once
    torch.testing.assert_close(gy32.double().sum(dim=(1, 2)), boundary[:, 3].to(F64), atol=1e-4, rtol=0)
    torch.testing.assert_close(gx32.double().sum(dim=(1, 2)), boundary[:, 2].to(F64), atol=1e-4, rtol=0)


@pytest.mark.parametrize("mi", MI)
def test_mi_float32_posteriors_hold_no_denormal_numbers(mi):
    """Occupancies too small for a normal float32 are zero (denormals slow every CPU op on them); the
    rest stay as accurate as float64 makes them."""
    g = _gen(5)
    B, S, T = 3, 12, 40
    px = torch.randn(B, S, T + 1, generator=g, dtype=F64)
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    px[:, :, : T // 2] -= 10.0  # early symbols are unlikely: many occupancies in float32's denormal range
    boundary = make_boundary(torch.tensor([12, 10, 7]), torch.tensor([40, 33, 25]))
    px = fix_boundary_column(px, boundary)
    _, (gx64, gy64) = mi(px, py, boundary, return_grad=True)
    tiny = torch.finfo(torch.float32).tiny
    smallest_denormal = 2.0**-149
    assert ((gx64 > smallest_denormal) & (gx64 < tiny)).sum() > 20, "the lattice must have float32-denormal occupancies"
    _, (gx32, gy32) = mi(px.float(), py.float(), boundary, return_grad=True)
    for got, want in ((gx32, gx64), (gy32, gy64)):
        assert not ((got > 0) & (got < tiny)).any()
        torch.testing.assert_close(got.double(), want, atol=1e-29, rtol=1e-6)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("mi", MI)
def test_mi_marks_only_the_sequence_with_a_nan_or_inf_arc(value, mi):
    g = _gen(6)
    B, S, T = 3, 4, 7
    px = fix_boundary_column(
        torch.randn(B, S, T + 1, generator=g, dtype=F64), make_boundary(torch.full((B,), S), torch.full((B,), T))
    )
    py = torch.randn(B, S + 1, T, generator=g, dtype=F64)
    clean = mi(px, py)
    py[2, 1, 3] = value
    dirty, (gx, gy) = mi(px, py, return_grad=True)
    assert torch.isnan(dirty[2]) and torch.isnan(gx[2]).all() and torch.isnan(gy[2]).all()
    assert torch.equal(dirty[:2], clean[:2]) and not torch.isnan(gx[:2]).any()


@pytest.mark.parametrize("mi", MI)
def test_mi_huge_finite_float64_arcs_are_not_mistaken_for_inf(mi):
    """Finite float64 arcs whose sum overflows must not mark the sequence as broken (NaN)."""
    # S = T = 1: the only live path is px[0, 0] then py[1, 0], of score -1e308 + 1e308 = 0
    px = torch.tensor([[[-1e308, NEG_INF]]], dtype=F64)  # (1, 1, 2)
    py = torch.tensor([[[1e308], [1e308]]], dtype=F64)  # (1, 2, 1): sums to +inf
    scores, (gx, gy) = mi(px, py, return_grad=True)
    assert scores.tolist() == [0.0]
    assert gx.tolist() == [[[1.0, 0.0]]] and gy.tolist() == [[[0.0], [1.0]]]


def fix_boundary_column(px: Tensor, boundary: Tensor) -> Tensor:
    """-inf at px[b, :, T] and px[b, :, t_end_b], as for a regular RNN-T."""
    px = px.clone()
    px[:, :, -1] = NEG_INF
    for b, t_end in enumerate(boundary[:, 3].tolist()):
        px[b, :, t_end] = NEG_INF
    return px


# --------------------------------------------------------------------------
# joint_mutual_information_recursion
# --------------------------------------------------------------------------


@pytest.mark.parametrize("modified", [False, True])
def test_joint_mi_splits_the_total_by_term(modified):
    g = _gen(3)
    B, S, T, N = 3, 3, 4, 3
    T1 = T if modified else T + 1
    pxs = [torch.randn(B, S, T1, generator=g, dtype=F64).requires_grad_() for _ in range(N)]
    pys = [torch.randn(B, S + 1, T, generator=g, dtype=F64).requires_grad_() for _ in range(N)]
    boundary = torch.tensor([[0, 0, S, T], [0, 1, 2, 4], [1, 0, 3, 3]])
    out = joint_mutual_information_recursion(pxs, pys, boundary)
    assert out.shape == (N, B)
    w = torch.rand(N, B, generator=g, dtype=F64) + 0.5
    (out * w).sum().backward()
    px_sum = sum(p.detach() for p in pxs)
    py_sum = sum(p.detach() for p in pys)
    for b in range(B):
        total, rx, ry = ref_scores_and_occupancy(px_sum[b], py_sum[b], boundary[b].tolist(), modified)
        parts = [float((rx * pxs[n][b].detach()).sum() + (ry * pys[n][b].detach()).sum()) for n in range(N)]
        parts[0] += total - sum(parts)  # log-of-sum minus sum-of-logs goes to term 0
        for n in range(N):
            assert out[n, b].item() == pytest.approx(parts[n], abs=1e-10, rel=1e-10)
            torch.testing.assert_close(pxs[n].grad[b], w[n, b] * rx, **TOL)
            torch.testing.assert_close(pys[n].grad[b], w[n, b] * ry, **TOL)
        assert out[:, b].sum().item() == pytest.approx(total, abs=1e-10, rel=1e-10)


def test_joint_mi_with_one_term_is_the_recursion():
    g = _gen(4)
    px = torch.randn(2, 3, 6, generator=g, dtype=F64)
    py = torch.randn(2, 4, 5, generator=g, dtype=F64)
    px[:, :, -1] = NEG_INF
    torch.testing.assert_close(
        joint_mutual_information_recursion([px], [py])[0], mutual_information_recursion(px, py), **TOL
    )
    with pytest.raises(ValueError):
        joint_mutual_information_recursion([px], [py, py])


# --------------------------------------------------------------------------
# the losses, every rnnt_type and delay_penalty
# --------------------------------------------------------------------------


def _joiner(a: Tensor, lm_out: Tensor, W: Tensor) -> Tensor:
    return torch.tanh(a + lm_out) @ W


def _joiner_case(seed: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """am (B,T,D), lm (B,S+1,D), W (D,C): joiner(a, l) = tanh(a + l) @ W."""
    g = _gen(seed)
    B, D = len(LENGTHS), 4
    am = torch.randn(B, T_MAX, D, generator=g, dtype=F64)
    lm = torch.randn(B, U_MAX + 1, D, generator=g, dtype=F64)
    W = torch.randn(D, C, generator=g, dtype=F64) * 2
    symbols = torch.randint(1, C, (B, U_MAX), generator=g)
    return am, lm, W, symbols


def _ref_losses(logp_of: Callable[[int], LogProbFn], symbols: Tensor, rnnt_type: str, delay: float = 0.0) -> Tensor:
    return torch.stack(
        [
            ref_transducer_nll(logp_of(b), symbols[b].tolist(), T_b, U_b, 0, rnnt_type, delay)
            for b, (T_b, U_b) in enumerate(LENGTHS)
        ]
    )


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("delay_penalty", [0.0, 0.3])
def test_full_loss_matches_reference(rnnt_type, delay_penalty):
    am, lm, W, symbols = _joiner_case(10)
    boundary = _boundary()
    params = [p.clone().requires_grad_() for p in (am, lm, W)]
    logits = _joiner(params[0][:, :, None], params[1][:, None], params[2])
    loss = rnnt_loss(logits, symbols, 0, boundary, rnnt_type=rnnt_type, delay_penalty=delay_penalty, reduction="none")
    w = _weights(len(LENGTHS))
    grads = torch.autograd.grad((loss * w).sum(), params)

    ref_params = [p.clone().requires_grad_() for p in (am, lm, W)]

    def logp_of(b: int) -> LogProbFn:
        return lambda t, u: _joiner(ref_params[0][b, t], ref_params[1][b, u], ref_params[2]).log_softmax(-1)

    ref = _ref_losses(logp_of, symbols, rnnt_type, delay_penalty)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_params)
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("delay_penalty", [0.0, 0.25])
def test_simple_and_smoothed_match_reference(rnnt_type, delay_penalty):
    lm, am, symbols = _lm_am(11)
    boundary = _boundary()
    w = _weights(len(LENGTHS))
    scales = (0.2, 0.15)
    for smoothed in (False, True):
        lm_l, am_l = lm.clone().requires_grad_(), am.clone().requires_grad_()
        if smoothed:
            loss = rnnt_loss_smoothed(
                lm_l,
                am_l,
                symbols,
                0,
                *scales,
                boundary,
                rnnt_type=rnnt_type,
                delay_penalty=delay_penalty,
                reduction="none",
            )
        else:
            loss = rnnt_loss_simple(
                lm_l, am_l, symbols, 0, boundary, rnnt_type=rnnt_type, delay_penalty=delay_penalty, reduction="none"
            )
        grads = torch.autograd.grad((loss * w).sum(), [lm_l, am_l])

        lm_r, am_r = lm.clone().requires_grad_(), am.clone().requires_grad_()
        rows = lm_r.softmax(-1).reshape(-1, C)  # unigram LM: mean over every (b, s), padding included
        log_unigram = rows.mean(0).log()

        def logp_of(b: int) -> LogProbFn:
            def lp(t: int, u: int) -> Tensor:
                joint = (lm_r[b, u] + am_r[b, t]).log_softmax(-1)
                if not smoothed:
                    return joint
                lm_only = lm_r[b, u].log_softmax(-1)
                am_only = (am_r[b, t] + log_unigram).log_softmax(-1)
                return (1 - sum(scales)) * joint + scales[0] * lm_only + scales[1] * am_only

            return lp

        ref = _ref_losses(logp_of, symbols, rnnt_type, delay_penalty)
        ref_grads = torch.autograd.grad((ref * w).sum(), [lm_r, am_r])
        torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("delay_penalty", [0.0, 0.2])
@pytest.mark.parametrize("s_range", [2, 3, U_MAX + 1])
def test_pruned_loss_matches_pruned_reference(rnnt_type, delay_penalty, s_range):
    am, lm, W, symbols = _joiner_case(12)
    boundary = _boundary()
    _, (gx, gy) = rnnt_loss_simple(lm @ W, am @ W, symbols, 0, boundary, rnnt_type=rnnt_type, return_grad=True)
    ranges = get_rnnt_prune_ranges(gx, gy, boundary, s_range)
    params = [p.clone().requires_grad_() for p in (am, lm, W)]
    am_p, lm_p = do_rnnt_pruning(params[0], params[1], ranges)
    loss = rnnt_loss_pruned(
        _joiner(am_p, lm_p, params[2]),
        symbols,
        ranges,
        0,
        boundary,
        rnnt_type=rnnt_type,
        delay_penalty=delay_penalty,
        reduction="none",
    )
    w = _weights(len(LENGTHS))
    grads = torch.autograd.grad((loss * w).sum(), params)

    ref_params = [p.clone().requires_grad_() for p in (am, lm, W)]

    def logp_of(b: int) -> LogProbFn:
        window = [set(ranges[b, t].tolist()) for t in range(T_MAX)]

        def lp(t: int, u: int) -> Optional[Tensor]:
            if t >= T_MAX or u not in window[t]:
                return None
            return _joiner(ref_params[0][b, t], ref_params[1][b, u], ref_params[2]).log_softmax(-1)

        return lp

    ref = _ref_losses(logp_of, symbols, rnnt_type, delay_penalty)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_params)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_hat_loss_matches_reference(rnnt_type):
    am, lm, W, symbols = _joiner_case(13)
    boundary = _boundary()
    B, T, S1 = am.shape[0], am.shape[1], lm.shape[1]
    ranges = torch.arange(S1).expand(B, T, S1).contiguous()
    params = [p.clone().requires_grad_() for p in (am, lm, W)]
    logits = _joiner(*do_rnnt_pruning(params[0], params[1], ranges), params[2])
    loss = rnnt_loss_pruned(
        logits, symbols, ranges, 0, boundary, rnnt_type=rnnt_type, reduction="none", use_hat_loss=True
    )
    grads = torch.autograd.grad(loss.sum(), params)

    ref_params = [p.clone().requires_grad_() for p in (am, lm, W)]

    def logp_of(b: int) -> LogProbFn:
        def lp(t: int, u: int) -> Tensor:
            z = _joiner(ref_params[0][b, t], ref_params[1][b, u], ref_params[2])
            p_blank = torch.sigmoid(z[0])
            return torch.cat([p_blank.log().reshape(1), (1 - p_blank).log() + z[1:].log_softmax(-1)])

        return lp

    ref = _ref_losses(logp_of, symbols, rnnt_type)
    ref_grads = torch.autograd.grad(ref.sum(), ref_params)
    torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError):
        rnnt_loss_pruned(logits, symbols, ranges, 1, boundary, use_hat_loss=True)


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_delay_penalty_shifts_each_symbol_by_its_frame(rnnt_type):
    """With one alignment dominating, the loss changes by delay * sum_k (t_k - (T_b - 1) / 2)."""
    S, T, T_b = 3, 6, 5
    frames_of_symbols = [0, 2, 2] if rnnt_type == "regular" else [0, 2, 3]
    lm = torch.zeros(1, S + 1, C, dtype=F64)
    am = torch.full((1, T, C), -40.0, dtype=F64)
    symbols = torch.tensor([[1, 2, 3]])
    for k, t in enumerate(frames_of_symbols):
        am[0, t, symbols[0, k]] = 40.0
    am[0, :, 0] = 0.0  # blank elsewhere
    boundary = torch.tensor([[0, 0, S, T_b]])
    base = rnnt_loss_simple(lm, am, symbols, 0, boundary, rnnt_type=rnnt_type, reduction="none")
    for delay in (0.5, -0.5):
        shifted = rnnt_loss_simple(
            lm, am, symbols, 0, boundary, rnnt_type=rnnt_type, delay_penalty=delay, reduction="none"
        )
        expected = base + (delay * sum(t - (T_b - 1) / 2 for t in frames_of_symbols) if delay > 0 else 0.0)
        torch.testing.assert_close(shifted, expected, atol=1e-6, rtol=0)


def test_delay_penalty_without_boundary_uses_T():
    lm, am, symbols = _lm_am(14)
    B, T = am.shape[0], am.shape[1]
    full = torch.tensor([[0, 0, U_MAX, T]] * B)
    for rnnt_type in RNNT_TYPES:
        a = rnnt_loss_simple(lm, am, symbols, 0, None, rnnt_type=rnnt_type, delay_penalty=0.4, reduction="none")
        b = rnnt_loss_simple(lm, am, symbols, 0, full, rnnt_type=rnnt_type, delay_penalty=0.4, reduction="none")
        torch.testing.assert_close(a, b, **TOL)


# --------------------------------------------------------------------------
# reduction, return_grad, boundary, rnnt_type checks
# --------------------------------------------------------------------------


def _all_losses(rnnt_type: str, reduction: str, delay_penalty: float = 0.0) -> Dict[str, Tensor]:
    am, lm, W, symbols = _joiner_case(15)
    boundary = _boundary()
    B, T, S1 = am.shape[0], am.shape[1], lm.shape[1]
    ranges = torch.arange(S1).expand(B, T, S1).contiguous()
    kw = dict(rnnt_type=rnnt_type, delay_penalty=delay_penalty, reduction=reduction)
    return {
        "simple": rnnt_loss_simple(lm @ W, am @ W, symbols, 0, boundary, **kw),
        "smoothed": rnnt_loss_smoothed(lm @ W, am @ W, symbols, 0, 0.1, 0.1, boundary, **kw),
        "full": rnnt_loss(_joiner(am[:, :, None], lm[:, None], W), symbols, 0, boundary, **kw),
        "pruned": rnnt_loss_pruned(_joiner(*do_rnnt_pruning(am, lm, ranges), W), symbols, ranges, 0, boundary, **kw),
    }


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_reductions(rnnt_type):
    none = _all_losses(rnnt_type, "none", 0.1)
    total = _all_losses(rnnt_type, "sum", 0.1)
    mean = _all_losses(rnnt_type, "mean", 0.1)
    for name, per_seq in none.items():
        assert per_seq.shape == (len(LENGTHS),)
        torch.testing.assert_close(total[name], per_seq.sum(), **TOL)
        torch.testing.assert_close(mean[name], per_seq.mean(), **TOL)
    # full range: pruned == full
    torch.testing.assert_close(none["pruned"], none["full"], **TOL)
    with pytest.raises(ValueError):
        _all_losses(rnnt_type, "batchmean")


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_return_grad_is_the_gradient_of_the_scores(rnnt_type, reduction):
    """return_grad gives d(-loss_b)/d px and d(-loss_b)/d py per sequence, whatever the reduction."""
    lm, am, symbols = _lm_am(16)
    boundary = _boundary()
    for fn, extra in ((rnnt_loss_simple, ()), (rnnt_loss_smoothed, (0.2, 0.1))):
        loss, (gx, gy) = fn(
            lm,
            am,
            symbols,
            0,
            *extra,
            boundary=boundary,
            rnnt_type=rnnt_type,
            delay_penalty=0.1,
            reduction=reduction,
            return_grad=True,
        )
        plain = fn(
            lm, am, symbols, 0, *extra, boundary=boundary, rnnt_type=rnnt_type, delay_penalty=0.1, reduction=reduction
        )
        torch.testing.assert_close(loss, plain, **TOL)
        if fn is rnnt_loss_simple:
            px, py = get_rnnt_logprobs(lm, am, symbols, 0, rnnt_type=rnnt_type, boundary=boundary)
        else:
            px, py = k2api.get_rnnt_logprobs_smoothed(
                lm, am, symbols, 0, *extra, boundary=boundary, rnnt_type=rnnt_type
            )
        px = k2api.apply_delay_penalty(px, boundary, rnnt_type, 0.1)
        assert gx.shape == px.shape and gy.shape == py.shape
        for b in range(len(LENGTHS)):
            ref, rx, ry = ref_scores_and_occupancy(px[b], py[b], boundary[b].tolist(), rnnt_type != "regular")
            torch.testing.assert_close(gx[b], rx, **TOL)
            torch.testing.assert_close(gy[b], ry, **TOL)


@pytest.mark.parametrize("rnnt_type", RNNT_TYPES)
def test_logprob_shapes_follow_rnnt_type(rnnt_type):
    lm, am, symbols = _lm_am(17)
    boundary = _boundary()
    B, T = am.shape[0], am.shape[1]
    px, py = get_rnnt_logprobs(lm, am, symbols, 0, rnnt_type, boundary)
    logits = lm[:, None] + am[:, :, None]
    jx, jy = get_rnnt_logprobs_joint(logits, symbols, 0, rnnt_type, boundary)
    T1 = T + 1 if rnnt_type == "regular" else T
    assert px.shape == jx.shape == (B, U_MAX, T1) and py.shape == jy.shape == (B, U_MAX + 1, T)
    torch.testing.assert_close(px, jx, **TOL)
    torch.testing.assert_close(py, jy, **TOL)
    if rnnt_type == "regular":
        assert (px[:, :, T] == NEG_INF).all()
        for b, t_end in enumerate(boundary[:, 3].tolist()):
            assert (px[b, :, t_end] == NEG_INF).all()
    else:
        plain = logits.log_softmax(-1)
        expect = torch.gather(plain[:, :, :U_MAX], 3, symbols[:, None, :, None].expand(B, T, U_MAX, 1))[..., 0]
        expect = expect.transpose(1, 2)
        if rnnt_type == "constrained":
            expect = expect + plain[:, :, 1:, 0].transpose(1, 2)
        torch.testing.assert_close(px, expect, **TOL)


def test_modified_types_need_enough_frames():
    lm, am, symbols = _lm_am(18)
    short = torch.tensor([[0, 0, 4, 3]] * len(LENGTHS))
    for rnnt_type in ("modified", "constrained"):
        with pytest.raises(ValueError):
            rnnt_loss_simple(lm, am, symbols, 0, short, rnnt_type=rnnt_type)
        with pytest.raises(ValueError):
            rnnt_loss_simple(lm[:, :, :], am[:, :3], symbols, 0, None, rnnt_type=rnnt_type)
    rnnt_loss_simple(lm, am, symbols, 0, short)  # regular: fine
    with pytest.raises(ValueError):
        rnnt_loss_simple(lm, am, symbols, 0, None, rnnt_type="standard")


def test_boundary_with_nonzero_begin_in_the_losses():
    """A boundary [s0, t0, s1, t1] scores the sub-lattice between the corners (k2's semantics)."""
    lm, am, symbols = _lm_am(19)
    boundary = torch.tensor([[1, 2, 3, 6], [0, 1, 4, 5], [2, 0, 4, 6], [0, 3, 0, 4]])
    for rnnt_type in RNNT_TYPES:
        loss, (gx, gy) = rnnt_loss_simple(
            lm, am, symbols, 0, boundary, rnnt_type=rnnt_type, reduction="none", return_grad=True
        )
        px, py = get_rnnt_logprobs(lm, am, symbols, 0, rnnt_type, boundary)
        for b in range(len(LENGTHS)):
            ref, rx, ry = ref_scores_and_occupancy(px[b], py[b], boundary[b].tolist(), rnnt_type != "regular")
            assert loss[b].item() == pytest.approx(-ref, abs=1e-10, rel=1e-10)
            torch.testing.assert_close(gx[b], rx, **TOL)
            torch.testing.assert_close(gy[b], ry, **TOL)


def test_rnnt_loss_equals_torchaudio_order():
    g = _gen(20)
    frames, syms = _lengths()
    logits = torch.randn(len(LENGTHS), T_MAX, U_MAX + 1, C, generator=g, dtype=F64)
    targets = torch.randint(1, C, (len(LENGTHS), U_MAX), generator=g)
    k2_style = rnnt_loss(logits, targets, 0, make_boundary(syms, frames), reduction="none")
    ta_style = rnnt_loss_torchaudio(logits, targets, frames, syms, blank=0, reduction="none")
    torch.testing.assert_close(k2_style, ta_style, **TOL)
    last = rnnt_loss(logits, targets - 1, C - 1, make_boundary(syms, frames), reduction="none")
    torch.testing.assert_close(
        rnnt_loss_torchaudio(logits, targets - 1, frames, syms, blank=-1, reduction="none"), last
    )


# --------------------------------------------------------------------------
# pruning windows of the modified lattices, and k2's deprecated windows
# --------------------------------------------------------------------------


@pytest.mark.parametrize("rnnt_type", ["modified", "constrained"])
@pytest.mark.parametrize("s_range", [1, 2, 3])
def test_prune_ranges_for_modified_lattices(rnnt_type, s_range):
    g = _gen(21)
    B, T, S = 5, 12, 7
    lm = torch.randn(B, S + 1, C, generator=g, dtype=F64) * 2
    am = torch.randn(B, T, C, generator=g, dtype=F64) * 2
    symbols = torch.randint(1, C, (B, S), generator=g)
    boundary = make_boundary(torch.tensor([7, 5, 2, 7, 0]), torch.tensor([12, 9, 12, 7, 10]))
    _, (gx, gy) = rnnt_loss_simple(lm, am, symbols, 0, boundary, rnnt_type=rnnt_type, return_grad=True)
    assert gx.shape == (B, S, T)
    ranges = get_rnnt_prune_ranges(gx, gy, boundary, s_range)
    assert ranges.shape == (B, T, s_range)
    s0 = ranges[:, :, 0]
    assert (s0[:, 0] == 0).all()
    step = s0[:, 1:] - s0[:, :-1]
    assert (step >= 0).all() and (step <= 1).all()  # one symbol per frame
    for b in range(B):
        U_b, T_b = boundary[b, 2].item(), boundary[b, 3].item()
        # the last real frame's window holds a cell the final arc can leave from: (U_b - 1) or U_b
        assert {U_b - 1, U_b} & set(ranges[b, T_b - 1].tolist())
        assert (s0[b, T_b - 1 :] <= max(U_b - s_range + 1, 0)).all()
    pruned = rnnt_loss_pruned(
        do_rnnt_pruning(am, lm, ranges)[0] + do_rnnt_pruning(am, lm, ranges)[1],
        symbols,
        ranges,
        0,
        boundary,
        rnnt_type=rnnt_type,
        reduction="none",
    )
    full = rnnt_loss_simple(lm, am, symbols, 0, boundary, rnnt_type=rnnt_type, reduction="none")
    assert (pruned >= full - 1e-9).all()
    if s_range >= 2:
        assert torch.isfinite(pruned).all()


def _ref_deprecated_starts(gx: Tensor, gy: Tensor, U_b: int, T_b: int, R: int) -> List[int]:
    """k2's earlier window starts for one sequence by loops: the window of R rows with the most
    occupancy (px + py) in frame t; then the same last-frame rule and adjustments."""
    S, T = gx.shape[0], gy.shape[1]
    starts = []
    for t in range(T):
        if t >= T_b - 1:
            starts.append(max(U_b - R + 1, 0))
            continue
        mass = [
            sum(float(gy[s, t]) + (float(gx[s, t]) if s < S else 0.0) for s in range(s0, s0 + R))
            for s0 in range(S + 2 - R)
        ]
        starts.append(max(range(len(mass)), key=lambda i: (mass[i], -i)))
    for t in range(T - 2, -1, -1):
        starts[t] = min(starts[t], starts[t + 1])
    for t in range(T - 2, -1, -1):
        starts[t] = max(starts[t], starts[t + 1] - (R - 1))
    return [min(s0, t * (R - 1)) for t, s0 in enumerate(starts)]


@pytest.mark.parametrize("s_range", [2, 3, 4])
def test_deprecated_prune_ranges_match_loop_reference(s_range):
    g = _gen(22)
    B, T, S = 4, 10, 6
    gx = torch.rand(B, S, T + 1, generator=g, dtype=F64)
    gy = torch.rand(B, S + 1, T, generator=g, dtype=F64)
    boundary = make_boundary(torch.tensor([6, 4, 2, 5]), torch.tensor([10, 8, 10, 7]))
    ranges = get_rnnt_prune_ranges_deprecated(gx, gy, boundary, s_range)
    for b in range(B):
        ref = _ref_deprecated_starts(gx[b], gy[b], boundary[b, 2].item(), boundary[b, 3].item(), s_range)
        assert ranges[b, :, 0].tolist() == ref
        torch.testing.assert_close(ranges[b], ranges[b, :, :1] + torch.arange(s_range))


# --------------------------------------------------------------------------
# signatures: k2's argument names, order and defaults
# --------------------------------------------------------------------------

_E = inspect.Parameter.empty
K2_SIGNATURES = {
    "mutual_information_recursion": [("px", _E), ("py", _E), ("boundary", None), ("return_grad", False)],
    "joint_mutual_information_recursion": [("px", _E), ("py", _E), ("boundary", None)],
    "fix_for_boundary": [("px", _E), ("boundary", None)],
    "get_rnnt_logprobs": [
        ("lm", _E),
        ("am", _E),
        ("symbols", _E),
        ("termination_symbol", _E),
        ("rnnt_type", "regular"),
        ("boundary", None),
    ],
    "get_rnnt_logprobs_joint": [
        ("logits", _E),
        ("symbols", _E),
        ("termination_symbol", _E),
        ("rnnt_type", "regular"),
        ("boundary", None),
    ],
    "get_rnnt_logprobs_smoothed": [
        ("lm", _E),
        ("am", _E),
        ("symbols", _E),
        ("termination_symbol", _E),
        ("lm_only_scale", 0.1),
        ("am_only_scale", 0.1),
        ("boundary", None),
        ("rnnt_type", "regular"),
    ],
    "get_rnnt_logprobs_pruned": [
        ("logits", _E),
        ("symbols", _E),
        ("ranges", _E),
        ("termination_symbol", _E),
        ("boundary", _E),
        ("rnnt_type", "regular"),
    ],
    "get_hat_logprobs_pruned": [
        ("logits", _E),
        ("symbols", _E),
        ("ranges", _E),
        ("termination_symbol", _E),
        ("boundary", _E),
        ("rnnt_type", "regular"),
    ],
    "rnnt_loss_simple": [
        ("lm", _E),
        ("am", _E),
        ("symbols", _E),
        ("termination_symbol", _E),
        ("boundary", None),
        ("rnnt_type", "regular"),
        ("delay_penalty", 0.0),
        ("reduction", "mean"),
        ("return_grad", False),
    ],
    "rnnt_loss_smoothed": [
        ("lm", _E),
        ("am", _E),
        ("symbols", _E),
        ("termination_symbol", _E),
        ("lm_only_scale", 0.1),
        ("am_only_scale", 0.1),
        ("boundary", None),
        ("rnnt_type", "regular"),
        ("delay_penalty", 0.0),
        ("reduction", "mean"),
        ("return_grad", False),
    ],
    "rnnt_loss": [
        ("logits", _E),
        ("symbols", _E),
        ("termination_symbol", _E),
        ("boundary", None),
        ("rnnt_type", "regular"),
        ("delay_penalty", 0.0),
        ("reduction", "mean"),
    ],
    "rnnt_loss_pruned": [
        ("logits", _E),
        ("symbols", _E),
        ("ranges", _E),
        ("termination_symbol", _E),
        ("boundary", None),
        ("rnnt_type", "regular"),
        ("delay_penalty", 0.0),
        ("reduction", "mean"),
        ("use_hat_loss", False),
    ],
    "get_rnnt_prune_ranges": [("px_grad", _E), ("py_grad", _E), ("boundary", _E), ("s_range", _E)],
    "get_rnnt_prune_ranges_deprecated": [("px_grad", _E), ("py_grad", _E), ("boundary", _E), ("s_range", _E)],
    "do_rnnt_pruning": [("am", _E), ("lm", _E), ("ranges", _E)],
}


@pytest.mark.parametrize("name", sorted(K2_SIGNATURES))
def test_signature_is_k2s(name):
    params = inspect.signature(getattr(k2api, name)).parameters
    assert [(p.name, p.default) for p in params.values()] == K2_SIGNATURES[name]
    assert name in k2api.__all__


@pytest.mark.parametrize("rnnt_type", ["regular", "modified"])
def test_a_nan_sequence_leaves_the_others_untouched(rnnt_type):
    """The recursion shares memory between neighbouring sequences; a NaN in one must not reach another
    (k2 computes each sequence on its own): the others' losses and posteriors are bit-identical, its own NaN."""
    import icefall_lite.nn.rnnt_loss as api

    gen = torch.Generator().manual_seed(7)
    B, T, S, V = 3, 12, 4, 9
    am = torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    lm = torch.randn(B, S + 1, V, generator=gen, dtype=torch.float64)
    symbols = torch.randint(1, V, (B, S), generator=gen)
    boundary = torch.tensor([[0, 0, 4, 12], [0, 0, 3, 10], [0, 0, 2, 8]])
    kw = dict(symbols=symbols, termination_symbol=0, boundary=boundary, rnnt_type=rnnt_type, reduction="none")
    clean, (px_clean, py_clean) = api.rnnt_loss_simple(lm, am, return_grad=True, **kw)
    am[1, 3, 2] = float("nan")
    dirty, (px_dirty, py_dirty) = api.rnnt_loss_simple(lm, am, return_grad=True, **kw)
    assert torch.isnan(dirty[1]) and torch.isnan(px_dirty[1]).all() and torch.isnan(py_dirty[1]).all()
    for b in (0, 2):
        assert torch.equal(dirty[b], clean[b])
        assert torch.equal(px_dirty[b], px_clean[b]) and torch.equal(py_dirty[b], py_clean[b])
