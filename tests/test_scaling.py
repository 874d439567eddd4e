"""Tests of icefall_lite.nn.scaling against plain PyTorch modules and hand formulas."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from icefall_lite.nn.scaling import (
    ActivationBalancer,
    BasicNorm,
    DoubleSwish,
    ScaledConv2d,
    ScaledEmbedding,
    ScaledLinear,
    ScaledLSTM,
)


def _zero_scales_and_copy(scaled: ScaledLSTM, plain: nn.LSTM) -> None:
    with torch.no_grad():
        for scale in scaled.scales():
            scale.zero_()
        for name in scaled._flat_weights_names:
            getattr(plain, name).copy_(getattr(scaled, name))


@pytest.mark.parametrize("proj_size", [0, 3])
def test_scaled_lstm_with_zero_scales_equals_nn_lstm(proj_size):
    torch.manual_seed(0)
    scaled = ScaledLSTM(5, 6, proj_size=proj_size, grad_filter_threshold=0.0)
    plain = nn.LSTM(5, 6, proj_size=proj_size)
    _zero_scales_and_copy(scaled, plain)
    assert scaled.grad_filter is None
    x1 = torch.randn(7, 4, 5, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    out1, (h1, c1) = scaled(x1)
    out2, (h2, c2) = plain(x2)
    assert torch.equal(out1, out2) and torch.equal(h1, h2) and torch.equal(c1, c2)
    upstream = torch.randn_like(out1)
    (out1 * upstream).sum().backward()
    (out2 * upstream).sum().backward()
    # threshold 0: no filter anywhere, gradients bit-identical to nn.LSTM's.
    assert torch.equal(x1.grad, x2.grad)
    for name in scaled._flat_weights_names:
        assert torch.equal(getattr(scaled, name).grad, getattr(plain, name).grad), name


def test_scaled_lstm_filter_changes_only_backward():
    torch.manual_seed(0)
    filtered = ScaledLSTM(5, 6, proj_size=3, grad_filter_threshold=2.0)
    unfiltered = ScaledLSTM(5, 6, proj_size=3, grad_filter_threshold=0.0)
    unfiltered.load_state_dict(filtered.state_dict())
    x = torch.randn(7, 4, 5)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, _ = filtered(x1)
    out2, _ = unfiltered(x2)
    assert torch.equal(out1, out2)
    upstream = torch.randn_like(out1)
    upstream[:, 1] *= 1e4  # one exploding sequence
    (out1 * upstream).sum().backward()
    (out2 * upstream).sum().backward()

    # Unfiltered: sequence 1's input gradient dominates; filtered: it is damped
    # relative to the others, and the weight gradients shrink.
    def ratio(g):
        norms = g.square().mean(dim=(0, 2)).sqrt()
        return float(norms[1] / norms[[0, 2, 3]].median())

    assert ratio(x1.grad) < ratio(x2.grad) / 2
    assert filtered.weight_ih_l0.grad.norm() < unfiltered.weight_ih_l0.grad.norm()
    stats = filtered.grad_filter.stats.as_dict()
    assert stats["fraction_filtered"] == pytest.approx(0.25)


def test_scaled_lstm_gradcheck_float64():
    torch.manual_seed(0)
    lstm = ScaledLSTM(3, 4, proj_size=2, grad_filter_threshold=0.0).double()
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda inp: lstm(inp)[0], (x,))


def test_scaled_lstm_refuses_bidirectional():
    with pytest.raises(ValueError, match="unidirectional"):
        ScaledLSTM(3, 4, bidirectional=True, grad_filter_threshold=0.0)


def test_scaled_lstm_init_effective_weight_scale():
    torch.manual_seed(0)
    hidden = 64
    lstm = ScaledLSTM(32, hidden, grad_filter_threshold=0.0)
    w = lstm.weight_hh_l0 * lstm.weight_hh_l0_scale.exp()
    # U(+-sqrt(3) std) has std `std`; times hidden^-0.5/std -> std hidden^-0.5.
    assert float(w.std()) == pytest.approx(hidden**-0.5, rel=0.05)
    assert torch.equal(lstm.bias_ih_l0, torch.zeros_like(lstm.bias_ih_l0))


def test_scaled_linear_and_conv_match_functional():
    torch.manual_seed(0)
    lin = ScaledLinear(6, 3, initial_scale=0.25)
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(2, 6)
    expected = F.linear(x, lin.weight * lin.weight_scale.exp(), lin.bias * lin.bias_scale.exp())
    torch.testing.assert_close(lin(x), expected, rtol=0, atol=0)
    # initial_scale=0.25, fan_in=6: effective weight std = 0.25 * 6^-0.5 (up to sampling).
    assert float(lin.bias_scale) == pytest.approx(math.log(0.25))
    conv = ScaledConv2d(2, 4, kernel_size=3, stride=2)
    img = torch.randn(1, 2, 9, 9)
    expected = F.conv2d(img, conv.weight * conv.weight_scale.exp(), conv.bias * conv.bias_scale.exp(), stride=2)
    torch.testing.assert_close(conv(img), expected, rtol=0, atol=0)


def test_scaled_lstm_scale_names_are_icefalls():
    """icefall's ScaledLSTM: one ``<flat weight name>_scale`` parameter per flat weight, after the LSTM's own."""
    lstm = ScaledLSTM(4, 8, proj_size=4, grad_filter_threshold=10.0)
    flat = ["weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_hr_l0"]
    assert [n for n, _ in lstm.named_parameters()] == flat + [f"{n}_scale" for n in flat]
    assert list(lstm.state_dict()) == flat + [f"{n}_scale" for n in flat]
    assert [float(s) for s in lstm.scales()] == [float(getattr(lstm, f"{n}_scale")) for n in flat]


def test_scaled_embedding():
    emb = ScaledEmbedding(10, 4, padding_idx=0)
    assert list(emb.state_dict()) == ["scale", "weight"]  # icefall's order
    ids = torch.tensor([[0, 3, 9]])
    out = emb(ids)
    assert torch.equal(out[0, 0], torch.zeros(4))
    torch.testing.assert_close(out[0, 1], emb.weight[3] * 10.0, rtol=1e-6, atol=0)


def test_basic_norm_formula():
    torch.manual_seed(0)
    norm = BasicNorm(5, channel_dim=-1, eps=0.25)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    expected = x / torch.sqrt((x**2).mean(dim=-1, keepdim=True) + 0.25)
    torch.testing.assert_close(norm(x), expected.to(norm(x).dtype), rtol=1e-6, atol=1e-7)
    assert isinstance(norm.eps, nn.Parameter)
    assert not isinstance(BasicNorm(5, learn_eps=False).eps, nn.Parameter)


def test_double_swish_value_and_gradcheck():
    x = torch.linspace(-6, 6, 41, dtype=torch.float64, requires_grad=True)
    y = DoubleSwish()(x)
    torch.testing.assert_close(y, x * torch.sigmoid(x - 1), rtol=0, atol=0)
    assert torch.autograd.gradcheck(DoubleSwish(), (x,))


def test_activation_balancer_backward_formula():
    torch.manual_seed(0)
    # channel 0: all positive (too many positives); channel 1: balanced, tiny |x|;
    # channel 2: balanced, |x| within range.
    x = torch.stack([torch.rand(50) + 0.5, (torch.rand(50) - 0.5) * 0.01, torch.randn(50)], dim=-1).requires_grad_()
    max_factor = 0.04
    bal = ActivationBalancer(3, channel_dim=-1, max_factor=max_factor, prob=1.0).train()
    y = bal(x)
    assert torch.equal(y, x)
    g = torch.randn(50, 3)
    (y * g).sum().backward()
    # Channel 0: proportion positive 1.0 > 0.95 -> factor (1 - 0.95) * mf / (0.95 - 1) = -mf
    expected0 = g[:, 0] + g[:, 0].abs() * max_factor
    torch.testing.assert_close(x.grad[:, 0], expected0)
    # Channel 1: mean |x| < 0.2 -> push away from 0: grad - |grad| * (sign(x) * mf)
    sign = (x[:, 1] > 0).float() - 0.5
    expected1 = g[:, 1] - g[:, 1].abs() * sign * 2 * max_factor
    torch.testing.assert_close(x.grad[:, 1], expected1)
    torch.testing.assert_close(x.grad[:, 2], g[:, 2])
    # eval mode: identity with untouched gradient
    x.grad = None
    bal.eval()
    (bal(x) * g).sum().backward()
    assert torch.equal(x.grad, g)
