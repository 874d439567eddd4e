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
from torch import Tensor

from icefall_lite.nn.clip import (
    AutoClipThreshold,
    GradientFilter,
    ScaledAdamClipping,
    ZClipThreshold,
    percentile_linear,
)
from icefall_lite.nn.model import add_model_arguments
from icefall_lite.nn.scaling import ScaledLSTM
from icefall_lite.train.args import add_training_arguments
from icefall_lite.train.grad_control import GradientControl, check_gradient_control_args


def _control(**on: float) -> GradientControl:
    """Every rule off but ``on``."""
    return GradientControl(**on)


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


# --------------------------------------------------------------------------
# ZClip
# --------------------------------------------------------------------------


def test_zclip_by_hand():
    """Warm-up of 3 norms, alpha 0.5: the statistics and the clip target worked out by hand (eps aside)."""
    rule = ZClipThreshold(z_threshold=2.5, alpha=0.5, warmup_steps=3)
    assert [float(rule.update(g)) for g in (1.0, 2.0, 3.0)] == [math.inf] * 3  # warm-up: never clipped (inf)
    assert rule.mean == 2.0 and rule.var == pytest.approx(2 / 3)  # population variance
    # z = (10 - 2) / sqrt(2/3) = 9.80 > 2.5: target = mean + z_thr^2 var / (g - mean) = 2 + 6.25 / 12.
    target = 2 + 6.25 / 12
    assert float(rule.update(10.0)) == pytest.approx(target, rel=1e-6)
    # The EMAs take the clipped norm, mean first, the variance around the new mean.
    mean = (2 + target) / 2
    assert rule.mean == pytest.approx(mean, rel=1e-6)
    assert rule.var == pytest.approx((2 / 3) / 2 + (target - mean) ** 2 / 2, rel=1e-6)
    var = rule.var
    # A norm below the mean: no clipping, the EMAs take it as it is.
    assert math.isinf(rule.update(2.0))
    assert rule.mean == pytest.approx((mean + 2) / 2, rel=1e-6)
    assert rule.var == pytest.approx(var / 2 + (2 - (mean + 2) / 2) ** 2 / 2, rel=1e-6)
    # Just inside the threshold (z = 2.4): not clipped.
    std = rule.var**0.5
    assert math.isinf(rule.update(rule.mean + 2.4 * std))


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
        norm, scale = map(float, control.clip(model))
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
        target = float(replay.update(norm))
        expected = 1.0 if math.isinf(target) else target / (norm + 1e-6)
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
# ScaledAdam's rule
# --------------------------------------------------------------------------


class _WithScalars(nn.Module):
    """Matrices, a zero-initialised bias (RMS 0), a random bias, a scalar and a one-element vector (both
    weighted by scalar_lr_scale, not by their RMS)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)
        nn.init.zeros_(self.b.bias)
        self.gain = nn.Parameter(torch.tensor(0.3))
        self.offset = nn.Parameter(torch.tensor([0.5]))


def _scaled_adam_run(control: GradientControl, model: nn.Module, steps: range, spikes=(15, 45, 120, 200, 201)):
    """Random gradients (x30 at ``spikes``), clipped by ``control``, then a plain SGD step (so the weights'
    RMS moves). Returns per step (weights before the step, gradients, scale)."""
    out = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        size = (1.0 + 2 * float(torch.rand((), generator=gen))) * (30 if step in spikes else 1)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * size
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        _, scale = map(float, control.clip(model))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.02 * p.grad
        out.append((weights, grads, scale))
    return out


def _icefall_scales(record, clipping_scale=2.0, period=100, scalar_lr_scale=0.1, size_update_period=4):
    """icefall's rule from its definition, in float64: the weighted norm of step s uses the RMS measured at
    the last of step 0 and the steps t < s with t % 4 == 3 (before their update); the threshold of step s
    is set at the last estimation step e <= s (10, 20, 40, then the multiples of the period) from the norms
    of steps 1..e (e of them, threshold doubled) or of the last ``period`` steps up to e: clipping_scale x
    their ascending (n // 4) * 2-th; step 0 and steps before 10 are not clipped."""
    norms, scales = [None], [1.0]
    irregular = [i for i in (10, 20, 40) if i < period]
    for s in range(1, len(record)):
        measured = max([0] + [t for t in range(s) if t % size_update_period == size_update_period - 1])
        weights = record[measured][0]
        grads = record[s][1]
        total = 0.0
        for name, g in grads.items():
            w = weights[name].double()
            factor = scalar_lr_scale if w.numel() == 1 else float(w.square().mean().sqrt())
            total += float((g.double() * factor).square().sum())
        norms.append(math.sqrt(total))
        estimates = [e for e in range(1, s + 1) if e in irregular or e % period == 0]
        if not estimates:
            scales.append(1.0)
            continue
        e = estimates[-1]
        window = sorted(norms[1 : e + 1]) if e in irregular else sorted(norms[e - period + 1 : e + 1])
        threshold = clipping_scale * window[(len(window) // 4) * 2] * (2.0 if e in irregular else 1.0)
        scales.append(min(1.0, threshold / norms[s]))
    return scales


def test_scaled_adam_rule_is_icefalls():
    """--scaled-adam-clipping-scale 2 over 230 steps against icefall's rule written from its definition
    (independently of the ring of norms the class keeps, as icefall's _get_clipping_scale)."""
    record = _scaled_adam_run(_control(scaled_adam_clipping_scale=2.0), _WithScalars(), range(230))
    ours = [scale for _, _, scale in record]
    reference = _icefall_scales(record)
    assert ours == pytest.approx(reference, rel=1e-5)
    assert all(s == 1.0 for s in ours[:10])
    clipped = [i for i, s in enumerate(ours) if s < 1.0]
    assert {15, 45, 120, 200, 201} <= set(clipped)


class ScaledAdamControl(GradientControl):
    """GradientControl with ScaledAdam's rule at another clipping_update_period (tests only)."""

    def __init__(self, period: int) -> None:
        super().__init__(scaled_adam_clipping_scale=2.0)
        self.scaled_adam = ScaledAdamClipping(2.0, clipping_update_period=period)


def test_scaled_adam_rule_short_period_and_first_estimates():
    """A period of 7: no irregular estimates (10 > 7), thresholds at steps 7, 14, ... from 7 norms."""
    record = _scaled_adam_run(ScaledAdamControl(period=7), _WithScalars(), range(60))
    assert [s for _, _, s in record] == pytest.approx(_icefall_scales(record, period=7), rel=1e-5)


def test_scaled_adam_rule_doubles_early_thresholds_and_skips_step_zero():
    """By hand: step 0 is not recorded; at step 10 the threshold is 2 x 2 x the 5th smallest of the norms of
    steps 1..10."""
    rule = ScaledAdamClipping(2.0)
    p = nn.Parameter(torch.ones(4))  # RMS 1: the weighted norm is the gradient's norm
    scales = []
    for step, size in enumerate([1000.0] + [float(k) for k in range(1, 11)] + [25.0]):
        p.grad = torch.full((4,), size / 2)  # norm = size
        scales.append(rule.scale([("p", p)]))
    assert scales[:10] == [1.0] * 10  # step 0 (norm 1000) neither clipped nor recorded; no threshold yet
    assert rule.threshold == pytest.approx(2 * 2 * 5.0)  # norms 1..10: the 5th smallest is 5
    assert scales[10] == 1.0  # norm 10 <= 20
    assert scales[11] == pytest.approx(20.0 / 25.0)


def test_scaled_adam_rule_resumes_exactly():
    """Saved after step 57 (between RMS measurements, after the early estimates), restored into a new
    control: the rest of the run clips exactly as the uninterrupted one."""
    whole = _scaled_adam_run(_control(scaled_adam_clipping_scale=2.0), _WithScalars(), range(160))
    model = _WithScalars()
    first = _control(scaled_adam_clipping_scale=2.0)
    _scaled_adam_run(first, model, range(58))
    second = _control(scaled_adam_clipping_scale=2.0)
    second.load_state_dict(_round_trip(first.state_dict()))
    rest = _scaled_adam_run(second, model, range(58, 160))
    assert [s for _, _, s in rest] == [s for _, _, s in whole[58:]]
    assert any(s < 1.0 for _, _, s in rest)


def test_scaled_adam_rule_refused_with_the_scaled_adam_optimizer(capsys):
    parser = _parser()
    args = parser.parse_args(["--optimizer", "scaled-adam", "--scaled-adam-clipping-scale", "2"])
    with pytest.raises(SystemExit):
        check_gradient_control_args(parser, args)
    assert "--scaled-adam-clipping-scale: --optimizer scaled-adam clips by its own rule" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--error-clip", "--recurrent-grad-clip"])
def test_absolute_in_backward_clips_refused_under_the_grad_scaler(flag, capsys):
    """Under --use-fp16 backward carries the loss-scaled gradient: an absolute threshold there would follow the
    scale. Refused by name (the check runs on any machine: args are parsed here, not by train.py)."""
    parser = _parser()
    args = parser.parse_args(["--use-fp16", "true", flag, "30"])
    with pytest.raises(SystemExit):
        check_gradient_control_args(parser, args)
    assert f"{flag} with --use-fp16" in capsys.readouterr().err
    check_gradient_control_args(parser, parser.parse_args(["--use-bf16", "true", flag, "30"]))  # accepted


# --------------------------------------------------------------------------
# The hard-mask GradientFilter
# --------------------------------------------------------------------------


def _lstm_pair(threshold: float, mode: str, proj_size: int = 3):
    """A filtered ScaledLSTM and an unfiltered twin with the same weights."""
    torch.manual_seed(0)
    filtered = ScaledLSTM(5, 6, proj_size=proj_size, grad_filter_threshold=threshold, grad_filter_mode=mode)
    plain = ScaledLSTM(5, 6, proj_size=proj_size, grad_filter_threshold=0.0)
    plain.load_state_dict(filtered.state_dict())
    return filtered, plain


def _lstm_grads(lstm: nn.Module, x: Tensor, weights: Tensor):
    x = x.clone().requires_grad_()
    output, _ = lstm(x)
    (output * weights).sum().backward()
    return x.grad, {n: p.grad.clone() for n, p in lstm.named_parameters()}


def _outlier_batch(seed: int = 0, outliers=(2, 5)):
    """Input (T=7, N=8, 5) and output-gradient weights with ``outliers`` sequences 1000x the others."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 8, 5, generator=gen)
    weights = torch.randn(7, 8, 3, generator=gen)
    for b in outliers:
        weights[:, b] *= 1000.0
    return x, weights


@pytest.mark.parametrize("proj_size", [0, 3])
def test_hard_mask_drops_the_outlier_sequences_exactly(proj_size):
    """Brute force: the sequences whose input-gradient RMS (with the full gradient) is above 10 x the median
    are found; the reference gradients are those of the loss over the other sequences alone."""
    filtered, plain = _lstm_pair(10.0, "hard-mask", proj_size)
    x, weights = _outlier_batch()
    if proj_size == 0:
        weights = torch.cat([weights, weights], dim=2)  # output size 6
    x_grad_all, _ = _lstm_grads(plain, x, weights)
    rms = x_grad_all.square().mean(dim=(0, 2)).sqrt()
    dropped = rms > 10.0 * rms.median()
    assert dropped.tolist() == [b in (2, 5) for b in range(8)]
    plain.zero_grad()
    ref_x_grad, ref_grads = _lstm_grads(plain, x, weights * (~dropped).float().view(1, 8, 1))
    got_x_grad, got_grads = _lstm_grads(filtered, x, weights)
    torch.testing.assert_close(got_x_grad, ref_x_grad, rtol=1e-5, atol=1e-7)
    assert got_x_grad[:, dropped].abs().max() == 0.0
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    stats = filtered.grad_filter.stats.as_dict()
    assert stats["fraction_filtered"] == pytest.approx(2 / 8) and stats["param_scale"] == 1.0


def test_hard_mask_without_outliers_is_no_filter_at_all():
    """No sequence above the cutoff: every gradient is exactly the unfiltered one (no soft scaling), where
    the soft filter scales them all."""
    filtered, plain = _lstm_pair(10.0, "hard-mask")
    soft, _ = _lstm_pair(10.0, "soft")
    x, weights = _outlier_batch(outliers=())
    got = _lstm_grads(filtered, x, weights)
    ref = _lstm_grads(plain, x, weights)
    softened = _lstm_grads(soft, x, weights)
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(got[1][n], g) for n, g in ref[1].items())
    assert not torch.equal(softened[0], ref[0])
    assert filtered.grad_filter.stats.as_dict()["fraction_filtered"] == 0.0


def test_hard_mask_observing_and_forward():
    """threshold inf observes only; the forward of every mode is the LSTM's; no grad: no filter."""
    observing, plain = _lstm_pair(math.inf, "hard-mask")
    x, weights = _outlier_batch()
    got, ref = _lstm_grads(observing, x, weights), _lstm_grads(plain, x, weights)
    assert torch.equal(got[0], ref[0])
    assert observing.grad_filter.stats.as_dict()["max_over_median"] > 100
    with torch.no_grad():
        assert torch.equal(observing(x)[0], plain(x)[0])
    assert torch.equal(observing(x)[1][1], plain(x)[1][1])


def test_grad_filter_mode_flag_reaches_every_layer_and_old_configs_build():
    from icefall_lite.nn.model import build_transducer
    from icefall_lite.train.setup import training_model_config

    parser = _parser()
    args = parser.parse_args(["--grad-filter-mode", "hard-mask", "--num-encoder-layers", "2", "--encoder-dim", "16"])
    args.rnn_hidden_size = args.dim_feedforward = args.decoder_dim = args.joiner_dim = 16
    config = training_model_config(args, vocab_size=10, blank_id=0)
    assert config["grad_filter_mode"] == "hard-mask"
    model = build_transducer(**config)
    modes = [f.mode for _, f in model.encoder.gradient_filters()]
    assert modes == ["hard-mask", "hard-mask"]
    del config["grad_filter_mode"]  # a configuration saved before the flag existed: icefall's soft filter
    assert [f.mode for _, f in build_transducer(**config).encoder.gradient_filters()] == ["soft", "soft"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--grad-filter-mode", "hard"])
    with pytest.raises(ValueError, match="--grad-filter-mode must be one of soft, hard-mask, uniform"):
        GradientFilter(1, 10.0, mode="hard")
    with pytest.raises(ValueError, match="--grad-filter-mode"):  # a bad mode is refused without a filter too
        ScaledLSTM(5, 6, grad_filter_threshold=0.0, grad_filter_mode="hard")


# --------------------------------------------------------------------------
# Kaldi's recurrent derivative cap
# --------------------------------------------------------------------------


def _manual_bptt(lstm: ScaledLSTM, x: Tensor, out_grad: Tensor, threshold: float):
    """The LSTM's forward and its backward written out by hand in float64, with Kaldi's cap on the
    derivative that frame t+1 sends back into [r_t, c_t] (r the projection, or h without one). Returns the
    input gradient, the gradient of each stored flat weight, and the number of capped rows."""
    names = lstm._flat_weights_names
    scales = {n: float(s.detach().exp()) for n, s in zip(names, lstm.scales())}
    W = {n: getattr(lstm, n).detach().double() * scales[n] for n in names}
    w_ih, w_hh, bias = W["weight_ih_l0"], W["weight_hh_l0"], W["bias_ih_l0"] + W["bias_hh_l0"]
    w_hr = W.get("weight_hr_l0")
    x, dy = x.double(), out_grad.double()
    T, N, _ = x.shape
    H = lstm.hidden_size
    r = [torch.zeros(N, w_hh.shape[1], dtype=torch.float64)]
    c = [torch.zeros(N, H, dtype=torch.float64)]
    cache = []
    for t in range(T):
        a = x[t] @ w_ih.T + bias + r[-1] @ w_hh.T
        i, f, g, o = torch.sigmoid(a[:, :H]), torch.sigmoid(a[:, H : 2 * H]), torch.tanh(a[:, 2 * H : 3 * H]), None
        o = torch.sigmoid(a[:, 3 * H :])
        c.append(f * c[-1] + i * g)
        m = o * torch.tanh(c[-1])
        r.append(m @ w_hr.T if w_hr is not None else m)
        cache.append((i, f, g, o, m))
    grads = {n: torch.zeros_like(W[n]) for n in names}
    dx = torch.zeros_like(x)
    dr_rec = torch.zeros_like(r[0])
    dc_rec = torch.zeros_like(c[0])
    capped = 0
    for t in reversed(range(T)):
        i, f, g, o, m = cache[t]
        dr = dy[t] + dr_rec
        if w_hr is not None:
            grads["weight_hr_l0"] += dr.T @ m
            dm = dr @ w_hr
        else:
            dm = dr
        tc = torch.tanh(c[t + 1])
        do = dm * tc
        dc = dc_rec + dm * o * (1 - tc**2)
        di, dg, df = dc * g, dc * i, dc * c[t]
        da = torch.cat([di * i * (1 - i), df * f * (1 - f), dg * (1 - g**2), do * o * (1 - o)], dim=1)
        grads["weight_ih_l0"] += da.T @ x[t]
        grads["weight_hh_l0"] += da.T @ r[t]
        grads["bias_ih_l0"] += da.sum(0)
        grads["bias_hh_l0"] += da.sum(0)
        dx[t] = da @ w_ih
        dr_rec, dc_rec = da @ w_hh, dc * f  # the derivative frame t sends back into [r_{t-1}, c_{t-1}]
        if t > 0:
            norm = (dr_rec.square().sum(1, keepdim=True) + dc_rec.square().sum(1, keepdim=True)).sqrt()
            factor = torch.where(norm > threshold, threshold / norm, torch.ones_like(norm))
            capped += int((norm > threshold).sum())
            dr_rec, dc_rec = dr_rec * factor, dc_rec * factor
    return dx, {n: grads[n] * scales[n] for n in names}, capped


@pytest.mark.parametrize("proj_size", [0, 3])
def test_recurrent_grad_clip_is_kaldis_cap_by_hand(proj_size):
    torch.manual_seed(0)
    lstm = ScaledLSTM(5, 6, proj_size=proj_size, grad_filter_threshold=0.0, recurrent_grad_clip=0.5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, 5, generator=gen)
    out_grad = torch.randn(9, 4, proj_size or 6, generator=gen) * torch.linspace(0.2, 30, 4).view(1, 4, 1)
    _, _, capped_off = _manual_bptt(lstm, x, out_grad, math.inf)
    x_in = x.clone().requires_grad_()
    output, _ = lstm(x_in)
    (output * out_grad).sum().backward()
    dx, grads, capped = _manual_bptt(lstm, x, out_grad, 0.5)
    assert 0 < capped < 8 * 4 and capped_off == 0
    torch.testing.assert_close(x_in.grad.double(), dx, rtol=1e-4, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(getattr(lstm, name).grad.double(), g, rtol=1e-4, atol=1e-6, msg=name)
    assert lstm.recurrent_clip_stats.as_dict()["fraction_clipped"] == pytest.approx(capped / (8 * 4))


@pytest.mark.parametrize("proj_size", [0, 3])
def test_frame_by_frame_lstm_is_the_kernel_when_nothing_is_capped(proj_size):
    torch.manual_seed(0)
    fused = ScaledLSTM(5, 6, proj_size=proj_size, grad_filter_threshold=0.0)
    frames = ScaledLSTM(5, 6, proj_size=proj_size, grad_filter_threshold=0.0, recurrent_grad_clip=1e30)
    frames.load_state_dict(fused.state_dict())
    x = torch.randn(8, 3, 5)
    out_grad = torch.randn(8, 3, proj_size or 6)
    results = []
    for lstm in (fused, frames):
        x_in = x.clone().requires_grad_()
        output, (h_n, c_n) = lstm(x_in)
        (output * out_grad).sum().backward()
        results.append((output, h_n, c_n, x_in.grad, [p.grad for p in lstm.parameters()]))
    (a_out, a_h, a_c, a_dx, a_g), (b_out, b_h, b_c, b_dx, b_g) = results
    for a, b in [(a_out, b_out), (a_h, b_h), (a_c, b_c), (a_dx, b_dx), *zip(a_g, b_g)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert frames.recurrent_clip_stats.as_dict() == {"fraction_clipped": 0.0}


def test_recurrent_grad_clip_is_built_into_every_lstm_and_off_is_the_kernel(monkeypatch):
    from conftest import tiny_transducer

    lstms = [m for m in tiny_transducer().modules() if isinstance(m, ScaledLSTM)]
    assert lstms and all(m.recurrent_grad_clip == 0.0 for m in lstms)

    def refuse(*args):
        raise AssertionError("the frame-by-frame LSTM ran with the cap off")

    monkeypatch.setattr(ScaledLSTM, "_frame_by_frame", refuse)
    lstms[0](torch.randn(4, 2, lstms[0].input_size))  # the kernel
    lstms = [m for m in tiny_transducer(recurrent_grad_clip=30.0).modules() if isinstance(m, ScaledLSTM)]
    assert len(lstms) == 2 and all(m.recurrent_grad_clip == 30.0 for m in lstms)
    with pytest.raises(AssertionError, match="frame-by-frame"):
        lstms[0](torch.randn(4, 2, lstms[0].input_size))
    lstms[0].eval()
    lstms[0](torch.randn(4, 2, lstms[0].input_size))  # evaluation: the kernel
    lstms[0].train()
    with torch.no_grad():
        lstms[0](torch.randn(4, 2, lstms[0].input_size))


# --------------------------------------------------------------------------
# Through train.py
# --------------------------------------------------------------------------

ALL_RULES = (
    *("--clip-grad-norm", "0", "--zclip-z-threshold", "2.5", "--autoclip-percentile", "10"),
    *("--scaled-adam-clipping-scale", "2", "--grad-filter-mode", "hard-mask", "--recurrent-grad-clip", "30"),
    *("--error-clip", "0.001"),
)


def test_train_py_with_every_new_rule_resumes_exactly(tiny_data, tmp_path):
    """train.py with ZClip, AutoClip, ScaledAdam's rule, the hard-mask filter, the recurrent cap and the error
    clip: 3 batches,
    then resumed from checkpoint-3.pt to 6, equals 6 uninterrupted batches (losses, weights, rule states)."""
    from conftest import batch_losses, run_train

    whole = run_train(
        tiny_data, tmp_path / "whole", "--max-batches", "6", "--save-every-n", "3", "--tensorboard", "true", *ALL_RULES
    )
    assert whole.returncode == 0, whole.stderr
    assert "Recurrent derivative cap 30 in 2 LSTM layers" in whole.stderr
    from studies.tb_reader import read_scalars

    tags = ["recurrent_clip/layer0/fraction_clipped", "error_clip/layer1/fraction_clipped"]
    capped = read_scalars(tmp_path / "whole" / "tensorboard", tags)
    for tag in tags:
        assert [step for step, _ in capped[tag]] == [1, 2, 3, 4, 5, 6], tag  # logged every step
        assert all(0.0 <= value <= 1.0 for _, value in capped[tag]), tag
    first = run_train(tiny_data, tmp_path / "resumed", "--max-batches", "3", "--save-every-n", "3", *ALL_RULES)
    assert first.returncode == 0, first.stderr
    second = run_train(tiny_data, tmp_path / "resumed", "--max-batches", "6", "--save-every-n", "3", *ALL_RULES)
    assert second.returncode == 0, second.stderr
    assert "Loading checkpoint" in second.stderr
    full, resumed = batch_losses(tmp_path / "whole"), batch_losses(tmp_path / "resumed")
    assert all(resumed[b] == full[b] for b in (4, 5, 6))
    a = torch.load(tmp_path / "whole" / "checkpoint-6.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "checkpoint-6.pt", weights_only=False)
    assert set(a["grad_control"]) == {"zclip", "autoclip", "scaled_adam"}
    assert len(a["grad_control"]["autoclip"]["history"]) == 6 and a["grad_control"]["scaled_adam"]["step"] == 6
    assert a["grad_control"]["zclip"] == b["grad_control"]["zclip"]
    assert a["grad_control"]["autoclip"] == b["grad_control"]["autoclip"]
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
