"""Numeric tests of icefall_lite.nn.clip against independent references."""

import copy
import math

import pytest
import torch
import torch.nn as nn

from icefall_lite.nn.clip import (
    ClipCounts,
    ErrorClipByValue,
    GradientFilter,
    NonFiniteGradientError,
    adaptive_clip_grad_,
    add_error_clip,
    clip_grad_norm_,
    clip_grad_value_,
    error_clip,
)


def _params_with_grads(dtype: torch.dtype, scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), ()]
    params = []
    for shape in shapes:
        p = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("foreach", [None, False])
def test_clip_grad_norm_matches_torch(norm_type, dtype, foreach):
    ours = _params_with_grads(dtype, scale=10.0)
    theirs = copy.deepcopy(ours)
    for a, b in zip(ours, theirs):
        b.grad = a.grad.clone()
    max_norm = 1.5
    norm_ours = clip_grad_norm_(ours, max_norm, norm_type, foreach=foreach)
    norm_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    tol = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}[dtype]
    assert math.isclose(float(norm_ours), float(norm_theirs), rel_tol=tol)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol * 4, atol=tol)
    # The clipped global norm is max_norm (up to eps).
    flat = torch.cat([p.grad.double().flatten() for p in ours])
    assert float(torch.linalg.vector_norm(flat, norm_type)) == pytest.approx(max_norm, rel=max(tol * 10, 1e-5))


def test_clip_grad_norm_below_max_is_bit_identical_and_returns_preclip_norm():
    params = _params_with_grads(torch.float32, scale=0.01)
    before = [p.grad.clone() for p in params]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]))
    norm = clip_grad_norm_(params, max_norm=100.0)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_clip_grad_norm_scale_never_exceeds_one():
    # The DeepSpeed bug took max(1, max_norm / norm): tiny gradients got amplified.
    params = _params_with_grads(torch.float64, scale=1e-8)
    before = [p.grad.clone() for p in params]
    clip_grad_norm_(params, max_norm=1.0)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_clip_grad_norm_nonfinite_raises_with_name():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    model[1].weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"1\.weight"):
        clip_grad_norm_(model.named_parameters(), max_norm=1.0)
    assert "1.bias" not in _message(model)


def _message(model):
    try:
        clip_grad_norm_(model.named_parameters(), max_norm=1.0)
    except NonFiniteGradientError as e:
        return str(e)
    return ""


def test_clip_grad_norm_nonfinite_report_leaves_grads_untouched():
    params = _params_with_grads(torch.float32, scale=10.0)
    params[2].grad[0, 0, 0] = float("inf")
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=1.0, error_if_nonfinite=False)
    assert not torch.isfinite(norm)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_clip_grad_value():
    params = _params_with_grads(torch.float32, scale=3.0)
    before = [p.grad.clone() for p in params]
    clip_grad_value_(params, 1.0)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, torch.clamp(g, -1.0, 1.0))
    params = _params_with_grads(torch.float32, scale=3.0)
    before = [p.grad.clone() for p in params]
    clip_grad_value_(params, max=2.0, min=-0.5)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, torch.clamp(g, -0.5, 2.0))
    with pytest.raises(ValueError):
        clip_grad_value_(params, max=-1.0, min=0.0)


def test_adaptive_clip_grad_matches_paper_formula():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 4, generator=gen).requires_grad_()
    weight.grad = torch.randn(6, 4, generator=gen) * torch.tensor([0.001, 1, 10, 0.001, 5, 0.0])[:, None]
    conv = torch.randn(3, 2, 3, 3, generator=gen).requires_grad_()
    conv.grad = torch.randn(3, 2, 3, 3, generator=gen)
    bias = torch.zeros(5).requires_grad_()  # zero-initialised: eps floor matters
    bias.grad = torch.randn(5, generator=gen)
    last = torch.randn(2, 4, generator=gen).requires_grad_()
    last.grad = torch.randn(2, 4, generator=gen) * 100
    clipping, eps = 0.05, 1e-3

    def paper(w, g):
        """Row/filter-wise for ndim > 1, whole tensor for a vector; returns (grad, n_clipped, n_units)."""
        out = g.clone()
        units = [slice(None)] if w.ndim <= 1 else list(range(w.shape[0]))
        n_clipped = 0
        for u in units:
            w_norm = max(float(w[u].norm()), eps)
            g_norm = float(g[u].norm())
            if g_norm / w_norm > clipping:
                out[u] = g[u] * (clipping * w_norm / g_norm)
                n_clipped += 1
        return out, n_clipped, len(units)

    results = [paper(p.detach(), p.grad) for p in (weight, conv, bias)]
    last_before = last.grad.clone()
    frac = adaptive_clip_grad_(
        [("w", weight), ("conv", conv), ("bias", bias), ("output", last)], clipping, eps, exclude=["output"]
    )
    for p, (expected, _, _) in zip((weight, conv, bias), results):
        torch.testing.assert_close(p.grad, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(last.grad, last_before)
    n_clipped = sum(r[1] for r in results)
    n_units = sum(r[2] for r in results)
    assert n_units == 6 + 3 + 1
    # rows 0, 3 (tiny) and 5 (zero) of the weight stay; the zero bias is clipped
    # against the eps floor rather than zeroed.
    assert 0 < n_clipped < n_units
    assert float(frac) == pytest.approx(n_clipped / n_units)
    assert torch.equal(weight.grad[5], torch.zeros(4))
    assert float(bias.grad.norm()) == pytest.approx(clipping * eps, rel=1e-5)


def test_error_clip_chain_rule_by_hand():
    # y = w * x ; z = error_clip(y) ; loss = sum(a * z ** 2)
    x = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([1.0, 0.1, 5.0], dtype=torch.float64)
    y = w * x
    counts = ClipCounts()
    z = error_clip(y, ErrorClipByValue(max=3.0, min=-1.0), counts)
    loss = (a * z**2).sum()
    loss.backward()
    # dL/dz = 2 a z = [4, -0.8, 60] -> clipped to [3, -0.8, 3]: 2 of the 3 elements changed
    dz = torch.tensor([3.0, -0.8, 3.0], dtype=torch.float64)
    assert counts.as_dict() == {"fraction_clipped": pytest.approx(2 / 3)}
    torch.testing.assert_close(x.grad, dz * 2.0, rtol=0, atol=1e-15)
    torch.testing.assert_close(w.grad, (dz * x.detach()).sum(), rtol=0, atol=1e-15)
    assert torch.equal(z, y)


def test_error_clip_counts_no_nan_as_clipped():
    x = torch.zeros(4, requires_grad=True)
    counts = ClipCounts()
    error_clip(x * 1.0, ErrorClipByValue(1.0), counts).backward(torch.tensor([float("nan"), 5.0, -0.5, float("inf")]))
    assert counts.as_dict() == {"fraction_clipped": 0.5}  # 5 and inf clamped; nan and -0.5 not


def test_error_clip_on_module_output():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    counts = ClipCounts()
    handle = add_error_clip(lin, ErrorClipByValue(0.5), counts)
    out = lin(x)
    (out * 10).sum().backward()
    assert counts.as_dict() == {"fraction_clipped": 1.0}
    (lin(x) * 0.1).sum().backward()  # a new forward starts the counts afresh: nothing clipped in its backward
    assert counts.as_dict() == {"fraction_clipped": 0.0}
    x.grad = None
    lin.zero_grad()
    (lin(x) * 10).sum().backward()
    # dL/dout = 10 everywhere, clipped to 0.5.
    torch.testing.assert_close(x.grad, torch.full((4, 2), 0.5) @ lin.weight.detach())
    torch.testing.assert_close(lin.bias.grad, torch.full((2,), 0.5 * 4))
    handle.remove()
    x.grad = None
    (lin(x) * 10).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4, 2), 10.0) @ lin.weight.detach())


def test_gradient_filter_backward_formula():
    torch.manual_seed(0)
    T, N, C = 5, 6, 4
    threshold = 10.0
    x = torch.randn(T, N, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(T, N, C, dtype=torch.float64)
    upstream[:, 2] *= 1000.0  # one exploded sequence
    w_upstream = torch.randn(3, 3, dtype=torch.float64)
    filt = GradientFilter(batch_dim=1, threshold=threshold)
    x_out, w_out = filt(x, w)
    assert torch.equal(x_out, x) and torch.equal(w_out, w)
    ((x_out * upstream).sum() + (w_out * w_upstream).sum()).backward()

    norms = [math.sqrt(float((upstream[:, b] ** 2).mean())) for b in range(N)]
    sorted_norms = sorted(norms)
    median = sorted_norms[(N - 1) // 2]  # torch.median: the lower median
    cutoff = threshold * median
    expected_x = upstream.clone()
    for b in range(N):
        expected_x[:, b] *= cutoff / (cutoff + norms[b])
    torch.testing.assert_close(x.grad, expected_x, rtol=1e-12, atol=0)
    param_scale = 1.0 / (1.0 + sum(norms) / N / cutoff)
    torch.testing.assert_close(w.grad, w_upstream * param_scale, rtol=1e-12, atol=0)
    # The exploded sequence is capped near the cutoff.
    capped = math.sqrt(float((x.grad[:, 2] ** 2).mean()))
    assert capped < cutoff and capped > 0.9 * cutoff
    stats = filt.stats.as_dict()
    assert stats["median_norm"] == pytest.approx(median, rel=1e-6)
    assert stats["max_over_median"] == pytest.approx(max(norms) / median, rel=1e-6)
    assert stats["fraction_filtered"] == pytest.approx(1 / N)
    assert stats["param_scale"] == pytest.approx(param_scale, rel=1e-6)


def test_gradient_filter_with_infinite_threshold_only_observes():
    torch.manual_seed(1)
    T, N, C = 5, 7, 3
    x = torch.randn(T, N, C, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    upstream = torch.randn(T, N, C)
    upstream[:, 4] *= 1e12  # an outlier far beyond any finite threshold's reach
    filt = GradientFilter(batch_dim=1, threshold=math.inf)
    x_out, w_out = filt(x, w)
    ((x_out * upstream).sum() + (w_out * 3.0).sum()).backward()
    assert torch.equal(x.grad, upstream)
    assert torch.equal(w.grad, torch.full((4,), 3.0))
    norms = sorted(float((upstream[:, b].double() ** 2).mean().sqrt()) for b in range(N))
    stats = filt.stats.as_dict()
    assert stats["median_norm"] == pytest.approx(norms[(N - 1) // 2], rel=1e-5)
    assert stats["max_over_median"] == pytest.approx(norms[-1] / norms[(N - 1) // 2], rel=1e-5)
    assert stats["fraction_filtered"] == 0.0
    assert stats["param_scale"] == 1.0


def test_gradient_filter_refuses_nonpositive_threshold():
    with pytest.raises(ValueError, match="threshold"):
        GradientFilter(batch_dim=1, threshold=0.0)


def test_gradient_filter_zero_gradient_is_passed_through():
    x = torch.randn(4, 3, 2, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    x_out, w_out = GradientFilter(batch_dim=1, threshold=10.0)(x, w)
    (w_out * 2.0).sum().backward()  # x gets an all-zero gradient
    assert torch.equal(w.grad, torch.full((5,), 2.0))
    assert torch.equal(x.grad, torch.zeros_like(x))
