"""Eve/Eden against their formulas; encoder shapes, streaming states and filters."""

import math
import subprocess
import sys

import pytest
import torch

from icefall_lite.nn.encoder import RNN
from icefall_lite.train.optim import Eden, Eve, ScaledAdam


def test_eden_formula():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = Eve([p], lr=0.003)
    sched = Eden(opt, lr_batches=5000, lr_epochs=10)
    sched.step_epoch(3)
    sched.step_batch(7000)
    expected = 0.003 * ((7000**2 + 5000**2) / 5000**2) ** -0.25 * ((9 + 100) / 100) ** -0.25
    assert sched.get_last_lr()[0] == pytest.approx(expected, rel=1e-12)
    state = sched.state_dict()
    sched2 = Eden(Eve([p], lr=0.003), 5000, 10)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_eve_first_step_is_adam_and_weight_decay_rule():
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.full((4,), 1.0))  # rms 1 > 0.1: decayed
    small = torch.nn.Parameter(torch.full((4,), 0.01))  # rms 0.01: not decayed
    scalar = torch.nn.Parameter(torch.tensor(1.9))
    grads = [torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([0.1, 0.1, -0.1, 0.3]), torch.tensor(-5.0)]
    for p, g in zip((big, small, scalar), grads):
        p.grad = g.clone()
    lr, wd = 0.01, 1e-3
    Eve([big, small, scalar], lr=lr, weight_decay=wd).step()

    # Adam's first step: m_hat = g, v_hat = g^2 -> update = lr * g / (|g| + eps)
    def adam_step(g):
        return lr * g / (g.abs() + 1e-8)

    torch.testing.assert_close(big.detach(), torch.full((4,), 1.0) * (1 - wd) - adam_step(grads[0]))
    torch.testing.assert_close(small.detach(), torch.full((4,), 0.01) - adam_step(grads[1]))
    # Scalars are clamped to [-10, 2] (1.9 + 0.01 -> 1.91; then push past 2).
    assert float(scalar) == pytest.approx(1.91)
    scalar.grad = torch.tensor(-1.0)
    opt = Eve([scalar], lr=1.0)
    opt.step()
    assert float(scalar) == 2.0


@pytest.mark.parametrize("threshold", [0.0, 25.0])
def test_encoder_shapes_and_filters(threshold):
    torch.manual_seed(0)
    enc = RNN(
        num_features=80,
        d_model=16,
        dim_feedforward=32,
        rnn_hidden_size=24,
        num_layers=2,
        grad_filter_threshold=threshold,
        dropout=0.1,
        layer_dropout=0.075,
    ).eval()
    x = torch.randn(3, 50, 80)
    x_lens = torch.tensor([50, 40, 9])
    out, out_lens, (h, c) = enc(x, x_lens)
    assert out.shape == (3, ((50 - 3) // 2 - 1) // 2, 16)
    assert out_lens.tolist() == [((t - 3) // 2 - 1) // 2 for t in (50, 40, 9)]
    assert out_lens.tolist()[2] == 1
    assert h.shape == (2, 3, 16) and c.shape == (2, 3, 24)
    assert len(enc.gradient_filters()) == (2 if threshold > 0 else 0)


def test_encoder_padding_does_not_change_valid_outputs():
    torch.manual_seed(0)
    enc = RNN(
        num_features=80,
        d_model=16,
        dim_feedforward=32,
        rnn_hidden_size=16,
        num_layers=2,
        grad_filter_threshold=10.0,
        dropout=0.1,
        layer_dropout=0.075,
    ).eval()
    x = torch.randn(1, 60, 80)
    out_short, lens_short, _ = enc(x[:, :40], torch.tensor([40]))
    padded = torch.cat([x[:, :40], torch.randn(1, 20, 80) * 100], dim=1)
    out_pad, _, _ = enc(padded, torch.tensor([40]))
    n = int(lens_short)
    # Output frame k sees input frames 4k .. 4k+10 only (three 3x3 convs,
    # strides 1, 2, 2) and the LSTMs are causal, so no valid frame sees padding.
    assert 4 * (n - 1) + 10 < 40
    torch.testing.assert_close(out_pad[:, :n], out_short, rtol=1e-5, atol=1e-5)


def test_encoder_streaming_states_continue_the_sequence():
    """Running the LSTM stack on two halves, carrying states, equals one pass."""
    torch.manual_seed(0)
    enc = RNN(
        num_features=80,
        d_model=16,
        dim_feedforward=32,
        rnn_hidden_size=16,
        num_layers=3,
        grad_filter_threshold=10.0,
        dropout=0.1,
        layer_dropout=0.075,
    ).eval()
    emb = torch.randn(10, 2, 16)
    full = emb
    for layer in enc.encoder.layers:
        full, _ = layer(full)
    first, second = emb[:6], emb[6:]
    states = [None] * 3
    for i, layer in enumerate(enc.encoder.layers):
        first, states[i] = layer(first)
    for i, layer in enumerate(enc.encoder.layers):
        second, _ = layer(second, states[i])
    torch.testing.assert_close(torch.cat([first, second]), full, rtol=1e-5, atol=1e-6)


def test_scaled_adam_first_step_by_hand():
    lr, beta1, eps = 0.05, 0.9, 1e-8
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    s = torch.nn.Parameter(torch.tensor(0.7))
    opt = ScaledAdam([w, s], lr=lr, clipping_scale=None, betas=(beta1, 0.98), eps=eps)
    w.grad = torch.tensor([[0.3, -0.1], [0.0, 2.0]])
    s.grad = torch.tensor(-4.0)
    rms = math.sqrt((1 + 4 + 9 + 0.25) / 4)
    w0, s0 = w.detach().clone(), float(s.detach())
    opt.step()
    # Step 1: v / (1 - beta2) = g^2, so the normalised gradient is g / (|g| + eps): each element moves by
    # lr * (1 - beta1) * rms(w) in the direction of -sign(g) (0 for a zero gradient).
    g = torch.tensor([[0.3, -0.1], [0.0, 2.0]])
    expected = w0 - lr * (1 - beta1) * rms * g / (g.abs() + eps)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-6, atol=1e-7)
    # Scalars: Adam with lr * scalar_lr_scale (0.1).
    assert float(s) == pytest.approx(s0 + lr * 0.1 * (1 - beta1), rel=1e-6)


def test_scaled_adam_update_is_relative_to_the_parameter_size():
    torch.manual_seed(0)
    direction = torch.randn(6, 5)
    grads = [torch.randn(6, 5) for _ in range(9)]
    moves = []
    for size in (0.1, 1.0):  # both rms inside [param_min_rms, param_max_rms]
        p = torch.nn.Parameter(direction * size)
        opt = ScaledAdam([p], lr=0.03, clipping_scale=None)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        moves.append(p.detach() - direction * size)
    # The same gradients move the 10x larger tensor 10x further (scale steps included).
    assert float((direction * 1.0).square().mean().sqrt()) < 3.0
    torch.testing.assert_close(moves[1], 10.0 * moves[0], rtol=1e-4, atol=1e-6)


def test_scaled_adam_clips_to_twice_the_median_norm():
    p = torch.nn.Parameter(torch.ones(4, 4))  # rms 1: the weighted norm is the plain norm
    opt = ScaledAdam([p], lr=1e-6, clipping_scale=2.0)
    for k in range(10):
        p.grad = torch.full((4, 4), 0.25 * (1 + k % 3))  # norms 1, 2, 3, 1, 2, ...
        opt.step()
    assert opt.num_clipped == 0  # no threshold before step 10
    p.grad = torch.full((4, 4), 10.0)  # norm 40 at step 10; median of the 10 norms before and it: 2
    opt.step()
    assert opt.num_clipped == 1
    assert opt.last_clipping_scale == pytest.approx(2.0 * 2.0 / 40.0, rel=1e-4)
    state = opt.state_dict()
    again = ScaledAdam([torch.nn.Parameter(torch.ones(4, 4))], lr=1e-6)
    again.load_state_dict(state)
    assert again.num_clipped == 1 and again._clip_threshold.threshold == opt._clip_threshold.threshold


def test_the_optimizers_train_save_and_load_without_importing_torch_dynamo():
    """Eve and ScaledAdam take torch.optim.Optimizer's add_param_group, zero_grad, state_dict and
    load_state_dict without the wrappers that import torch._dynamo (2 s of CPU a process), and they work as
    before: a state_dict reloaded into a fresh optimizer gives the same next step. In a fresh interpreter, since
    this one may have imported torch._dynamo already."""
    script = """
import sys
import torch
from icefall_lite.train.optim import Eve, ScaledAdam

for make in (lambda ps: Eve(ps, lr=0.01), lambda ps: ScaledAdam(ps, lr=0.01)):
    weights = []
    for reloaded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make(model.parameters())
        for step in range(3):
            if step == 2 and reloaded:
                state = opt.state_dict()
                opt = make(model.parameters())
                opt.load_state_dict(state)
            opt.zero_grad()
            model(torch.randn(5, 4)).square().sum().backward()
            opt.step()
        weights.append(model.weight.detach().clone())
    assert torch.equal(weights[0], weights[1]), type(opt).__name__
assert "torch._dynamo" not in sys.modules, "an optimizer method imported torch._dynamo"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
