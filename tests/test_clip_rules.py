"""The clipping rules that follow the gradient's history or act per sequence, each against its published rule
worked by hand or computed independently, and through a save/load round trip mid-run."""

import argparse
import io
import math
from typing import List

import numpy as np
import pytest
import torch
import torch.nn as nn

from icefall_lite.nn.clip import AutoClipThreshold, ZClipThreshold, percentile_linear
from icefall_lite.nn.model import add_model_arguments
from icefall_lite.train.args import add_training_arguments
from icefall_lite.train.grad_control import FLAGS, GradientControl, check_gradient_control_args


def _control(**on: float) -> GradientControl:
    return GradientControl(**{**{name: 0.0 for name in FLAGS}, **on})


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))


def _set_grads(model: nn.Module, seed: int, size: float) -> None:
    """Random gradients of global L2 norm ``size``."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    total = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    for p, g in zip(model.parameters(), grads):
        p.grad = g * (size / total)


def _norm_sequence(n: int, seed: int, spikes=()) -> List[float]:
    gen = torch.Generator().manual_seed(seed)
    sizes = [float(x) for x in torch.rand(n, generator=gen) * 2 + 1]
    for i, size in spikes:
        sizes[i] = size
    return sizes


def _round_trip(state):
    """A state through torch.save/torch.load, as a checkpoint carries it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    add_model_arguments(parser)
    return parser


def _group_flags(parser: argparse.ArgumentParser, title: str) -> List[str]:
    group = next(g for g in parser._action_groups if g.title == title)
    return [s for a in group._group_actions for s in a.option_strings]


# --------------------------------------------------------------------------
# ZClip
# --------------------------------------------------------------------------


def test_zclip_by_hand():
    """Warm-up of 3 norms, alpha 0.5: the statistics and the clip target worked out by hand (eps aside)."""
    rule = ZClipThreshold(z_threshold=2.5, alpha=0.5, warmup_steps=3)
    assert [rule.update(g) for g in (1.0, 2.0, 3.0)] == [None, None, None]  # warm-up: never clipped
    assert rule.mean == 2.0 and rule.var == pytest.approx(2 / 3)  # population variance
    # z = (10 - 2) / sqrt(2/3) = 9.80 > 2.5: target = mean + z_thr^2 var / (g - mean) = 2 + 6.25 / 12.
    target = 2 + 6.25 / 12
    assert rule.update(10.0) == pytest.approx(target, rel=1e-6)
    # The EMAs take the clipped norm, mean first, the variance around the new mean.
    mean = (2 + target) / 2
    assert rule.mean == pytest.approx(mean, rel=1e-6)
    assert rule.var == pytest.approx((2 / 3) / 2 + (target - mean) ** 2 / 2, rel=1e-6)
    var = rule.var
    # A norm below the mean: no clipping, the EMAs take it as it is.
    assert rule.update(2.0) is None
    assert rule.mean == pytest.approx((mean + 2) / 2, rel=1e-6)
    assert rule.var == pytest.approx(var / 2 + (2 - (mean + 2) / 2) ** 2 / 2, rel=1e-6)
    # Just inside the threshold (z = 2.4): not clipped.
    std = rule.var**0.5
    assert rule.update(rule.mean + 2.4 * std) is None


def test_zclip_refuses_bad_settings():
    with pytest.raises(ValueError, match="z_threshold"):
        ZClipThreshold(0.0)
    with pytest.raises(ValueError, match="alpha"):
        ZClipThreshold(2.5, alpha=1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        ZClipThreshold(2.5, warmup_steps=0)


def _run_control(control: GradientControl, sizes, seed: int = 0):
    """(norm, scale, clipped gradients) of ``control`` on a model whose gradients have the global norms
    ``sizes``, step by step."""
    out = []
    model = _model()
    for i, size in enumerate(sizes):
        _set_grads(model, seed + i, size)
        norm, scale = control.clip(model)
        out.append((norm, scale, [p.grad.clone() for p in model.parameters()]))
    return out


def test_zclip_matches_the_authors_package():
    """GradientControl --zclip-z-threshold 2.5 against the authors' own ZClip (PyPI zclip, default
    zscore / adaptive_scaling mode, without its optional hard cap) on the same gradients, spikes included."""
    zclip = pytest.importorskip("zclip")
    sizes = _norm_sequence(120, seed=3, spikes=[(10, 50.0), (40, 30.0), (41, 9.0), (90, 200.0)])
    ours = _run_control(_control(zclip_z_threshold=2.5), sizes)
    theirs = zclip.ZClip(z_thresh=2.5, max_grad_norm=None)
    model = _model()
    clipped = 0
    for i, (size, (norm, scale, grads)) in enumerate(zip(sizes, ours)):
        _set_grads(model, i, size)
        before = [p.grad.clone() for p in model.parameters()]
        their_norm = theirs.step(model)
        assert norm == pytest.approx(their_norm, rel=1e-6)
        for a, b in zip(grads, model.parameters()):
            torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=0)
        if scale < 1.0:
            clipped += 1
            assert any(not torch.equal(g, b.grad) for g, b in zip(before, model.parameters()))
        if i < 25:
            assert scale == 1.0  # warm-up
    assert clipped == 2 and ours[40][1] < 1.0 and ours[90][1] < 0.1  # 41 (9.0) is inside the widened band
    control = _control(zclip_z_threshold=2.5)
    _run_control(control, sizes)
    assert control.zclip.mean == pytest.approx(theirs.mean, rel=1e-6)
    assert control.zclip.var == pytest.approx(theirs.var, rel=1e-6)


def test_zclip_scale_is_the_target_over_the_norm():
    sizes = _norm_sequence(40, seed=5, spikes=[(30, 40.0)])
    control = _control(zclip_z_threshold=2.5)
    replay = ZClipThreshold(2.5)
    for norm, scale, grads in _run_control(control, sizes):
        target = replay.update(norm)
        expected = 1.0 if target is None else target / (norm + 1e-6)
        assert scale == pytest.approx(expected, rel=1e-6)
        assert math.sqrt(sum(float(g.double().square().sum()) for g in grads)) == pytest.approx(norm * scale, rel=1e-5)
    assert control.zclip.mean is not None


def test_zclip_resumes_exactly():
    """A control restored mid-run (during the warm-up and after it) from a saved state_dict clips the rest
    of the run exactly as the uninterrupted one."""
    sizes = _norm_sequence(80, seed=7, spikes=[(50, 60.0), (70, 25.0)])
    whole = _run_control(_control(zclip_z_threshold=2.5), sizes)
    for cut in (10, 45):
        first = _control(zclip_z_threshold=2.5)
        _run_control(first, sizes[:cut])
        second = _control(zclip_z_threshold=2.5)
        second.load_state_dict(_round_trip(first.state_dict()))
        rest = _run_control(second, sizes[cut:], seed=cut)
        assert [s for _, s, _ in rest] == [s for _, s, _ in whole[cut:]]
        uninterrupted = _control(zclip_z_threshold=2.5)
        _run_control(uninterrupted, sizes)
        assert (second.zclip.mean, second.zclip.var) == (uninterrupted.zclip.mean, uninterrupted.zclip.var)


# --------------------------------------------------------------------------
# AutoClip
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_is_numpys_default(n):
    gen = torch.Generator().manual_seed(n)
    values = sorted(float(x) for x in torch.rand(n, generator=gen) * 10)
    for p in (0, 1, 10, 25, 33.3, 50, 90, 99.9, 100):
        assert percentile_linear(values, p) == float(np.percentile(values, p)), p


def test_autoclip_by_hand():
    """p = 10 on the norms 4, 2, 8, 1: the threshold is the 10th percentile of the norms so far, this one
    included; only 8 is above its threshold."""
    control = _control(autoclip_percentile=10)
    got = [scale for _, scale, _ in _run_control(control, [4.0, 2.0, 8.0, 1.0])]
    # [4] -> 4; [2, 4] -> 2 + 0.1 x 2 = 2.2; [2, 4, 8] -> rank 0.2: 2 + 0.2 x 2 = 2.4; [1, 2, 4, 8] -> 1.3.
    assert got[0] == 1.0 and got[1] == 1.0 and got[3] == 1.0
    assert got[2] == pytest.approx(2.4 / 8, rel=1e-6)
    assert control.autoclip.history == pytest.approx([1.0, 2.0, 4.0, 8.0], rel=1e-6)


def test_autoclip_is_the_authors_reference_code():
    """The authors' reference (pseeth/autoclip autoclip.py), written out: append the norm to the history,
    clip_value = np.percentile(history, p), torch's clip_grad_norm_ to it."""
    sizes = _norm_sequence(150, seed=11, spikes=[(20, 30.0), (100, 80.0)])
    for p in (10.0, 50.0):
        ours = _run_control(_control(autoclip_percentile=p), sizes)
        model = _model()
        history = []
        for i, (size, (norm, scale, grads)) in enumerate(zip(sizes, ours)):
            _set_grads(model, i, size)
            history.append(math.sqrt(sum(float(q.grad.double().square().sum()) for q in model.parameters())))
            clip_value = float(np.percentile(history, p))
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_value)
            assert norm == pytest.approx(history[-1], rel=1e-6)
            for a, b in zip(grads, model.parameters()):
                torch.testing.assert_close(a, b.grad, rtol=2e-6, atol=0)
            assert (scale < 1.0) == (history[-1] > clip_value * (1 + 1e-6))
        assert sum(s < 1.0 for _, s, _ in ours) > (100 if p == 10 else 50)


def test_autoclip_refuses_bad_percentiles(capsys):
    with pytest.raises(ValueError, match="percentile"):
        AutoClipThreshold(100.5)
    parser = _parser()
    with pytest.raises(SystemExit):
        check_gradient_control_args(parser, parser.parse_args(["--autoclip-percentile", "101"]))
    assert "--autoclip-percentile must be at most 100" in capsys.readouterr().err


def test_autoclip_resumes_exactly():
    sizes = _norm_sequence(60, seed=13, spikes=[(40, 50.0)])
    whole = _run_control(_control(autoclip_percentile=10), sizes)
    first = _control(autoclip_percentile=10)
    _run_control(first, sizes[:30])
    second = _control(autoclip_percentile=10)
    second.load_state_dict(_round_trip(first.state_dict()))
    rest = _run_control(second, sizes[30:], seed=30)
    assert [s for _, s, _ in rest] == [s for _, s, _ in whole[30:]]
    assert len(second.autoclip.history) == 60


# --------------------------------------------------------------------------
# The flags
# --------------------------------------------------------------------------


def test_every_rule_has_one_flag_in_the_gradient_control_group():
    flags = _group_flags(_parser(), "gradient control")
    for name in FLAGS:
        assert "--" + name.replace("_", "-") in flags


@pytest.mark.parametrize("name", FLAGS)
def test_negative_thresholds_are_refused_naming_the_flag(name, capsys):
    parser = _parser()
    args = parser.parse_args([f"--{name.replace('_', '-')}", "-1"])
    with pytest.raises(SystemExit):
        check_gradient_control_args(parser, args)
    assert f"--{name.replace('_', '-')}" in capsys.readouterr().err
