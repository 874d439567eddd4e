"""Gradient control as train.py applies it (icefall_lite.train.grad_control), against torch's own clipping."""

import copy
import math

import pytest
import torch
import torch.nn as nn

from icefall_lite.nn.clip import RunningMedianThreshold
from icefall_lite.train.grad_control import GradientControl


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3.0
    return model


def _control(**on: float) -> GradientControl:
    off = dict(clip_grad_norm=0.0, clip_grad_value=0.0, agc_clipping=0.0, error_clip=0.0, clip_grad_norm_relative=0.0)
    return GradientControl(**{**off, **on})


def _norm(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))


def test_norm_clip_is_torchs_and_reports_its_scale():
    ours, ref = _model_with_grads(), _model_with_grads()
    pre = _norm(ours)
    norm, scale = map(float, _control(clip_grad_norm=1.0).clip(ours))
    torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    assert norm == pytest.approx(float(torch_norm), rel=1e-6) and norm == pytest.approx(pre, rel=1e-6)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert scale == pytest.approx(1.0 / (pre + 1e-6), rel=1e-6)
    assert _norm(ours) == pytest.approx(1.0, rel=1e-5)


def test_off_leaves_gradients_untouched_and_scale_one():
    ours, ref = _model_with_grads(), _model_with_grads()
    norm, scale = map(float, _control().clip(ours))
    assert (norm, scale) == (pytest.approx(_norm(ref), rel=1e-6), 1.0)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), ref.parameters()))


def test_value_then_norm_combine_in_order():
    ours, ref = _model_with_grads(1), _model_with_grads(1)
    pre = _norm(ref)
    norm, scale = map(float, _control(clip_grad_value=0.5, clip_grad_norm=1.0).clip(ours))
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.5)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert norm == pytest.approx(pre, rel=1e-6)
    assert scale == pytest.approx(_norm(ref) / pre, rel=1e-5)


def test_nonfinite_gradient_is_reported_and_not_clipped():
    model = _model_with_grads()
    model[0].weight.grad[0, 0] = float("inf")
    before = copy.deepcopy([p.grad for p in model.parameters()])
    norm, scale = map(float, _control(clip_grad_norm=1.0, clip_grad_value=0.1).clip(model))
    assert math.isinf(norm) and scale == 1.0
    assert all(torch.equal(a, b.grad) for a, b in zip(before, model.parameters()))


def _median_rule(norms, scale, period):
    """icefall ScaledAdam's threshold, worked out per step from the whole history: None before step 10;
    re-estimated at steps 10, 20, 40 and every ``period`` from the last min(step, period) norms up to it."""
    out, current = [], None
    for step in range(len(norms)):
        if step in (10, 20, 40) or (step > 0 and step % period == 0):
            window = sorted(norms[max(0, step + 1 - min(step, period)) : step + 1])
            current = scale * window[len(window) // 2]
        out.append(current)
    return out


def test_running_median_threshold_follows_icefalls_rule():
    gen = torch.Generator().manual_seed(0)
    norms = [float(x) for x in torch.rand(130, generator=gen) * 10 + 1]
    rule = RunningMedianThreshold(2.0, update_period=25)
    got = [float(rule.update(n)) for n in norms]  # inf: no threshold yet
    assert got == [math.inf if t is None else t for t in _median_rule(norms, 2.0, 25)]
    assert math.isinf(got[9]) and math.isfinite(got[10])


def test_relative_clip_clips_to_a_multiple_of_the_running_median_and_resumes_exactly():
    control = _control(clip_grad_norm_relative=2.0)
    gen = torch.Generator().manual_seed(1)
    sizes = [float(x) for x in torch.rand(60, generator=gen) * 4 + 1]
    sizes[30] = 100.0  # one outlier step
    norms, scales = [], []
    for size in sizes:
        model = _model_with_grads()
        factor = size / _norm(model)
        for p in model.parameters():
            p.grad.mul_(factor)
        norm, scale = map(float, control.clip(model))
        norms.append(norm)
        scales.append(scale)
    thresholds = _median_rule(norms, 2.0, 100)
    for norm, scale, threshold in zip(norms, scales, thresholds):
        expected = 1.0 if threshold is None else min(1.0, threshold / (norm + 1e-6))
        assert scale == pytest.approx(expected, rel=1e-5)
    assert scales[30] < 0.2 and all(s == 1.0 for s in scales[:10])
    # A control restored from the state after step 40 continues as the uninterrupted one.
    restored = _control(clip_grad_norm_relative=2.0)
    replay = _control(clip_grad_norm_relative=2.0)
    for norm in norms[:40]:
        replay.relative_threshold.update(norm)
    restored.load_state_dict(replay.state_dict())
    assert [float(restored.relative_threshold.update(n)) for n in norms[40:]] == thresholds[40:]
