"""The registry of gradient controls (icefall_lite.train.rules) and what is derived from it: train.py's
argument group, its validation, GradientControl, the model's wiring (the filter's mode and the recurrent cap
passed down at build time), the uniform filter (against the study's old class, kept here as an oracle)."""

import argparse
import math
import re
from typing import Dict, List

import pytest
import torch
import torch.nn as nn
from torch import Tensor

from conftest import TINY_TRANSDUCER, tiny_transducer
from icefall_lite.nn.clip import GRAD_FILTER_MODES, GradientFilter
from icefall_lite.nn.model import (
    DEFAULT_GRAD_FILTER_THRESHOLD,
    MODEL_PRESETS,
    add_model_arguments,
    build_transducer,
    model_config_from_args,
)
from icefall_lite.nn.scaling import ScaledLSTM
from icefall_lite.train.args import add_training_arguments
from icefall_lite.train.grad_control import (
    APPLIED_RULES,
    MODEL_RULES,
    GradientControl,
    add_gradient_control_arguments,
    check_gradient_control_args,
)
from icefall_lite.train.rules import DESTS, RULE_BY_NAME, RULES, Rule, Stage
from icefall_lite.train.setup import training_model_config


def _train_parser() -> argparse.ArgumentParser:
    """train.py's flags as train.py adds them: the training step's, then the model's."""
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    add_model_arguments(parser)
    return parser


def _help_section(parser: argparse.ArgumentParser, title: str) -> List[str]:
    """The flags ``--help`` lists under the heading ``title``."""
    sections = re.split(r"\n(?=\S[^\n]*:\n)", parser.format_help())
    section = next(s for s in sections if s.startswith(f"{title}:\n"))
    return re.findall(r"^  (--[a-z0-9-]+)", section, re.M) + re.findall(r", (--[a-z0-9-]+)", section)


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


def test_the_table_names_every_rule_once_filter_first_in_stage_order():
    assert RULES[0].name == "grad-filter-threshold" and RULES[0].off == math.inf
    assert RULES[0].default == DEFAULT_GRAD_FILTER_THRESHOLD == 25.0
    assert len(set(DESTS)) == len(RULES) == 10 and set(RULE_BY_NAME) == {r.name for r in RULES}
    order = [Stage.IN_BACKWARD, Stage.AFTER_BACKWARD, Stage.HISTORY, Stage.OPTIMIZER]
    stages = [order.index(r.stage) for r in RULES]
    assert stages == sorted(stages)
    assert all(r.off == 0.0 for r in RULES[1:])
    assert {r.name: r.state_key for r in RULES if r.state_key} == {
        "clip-grad-norm-relative": "relative_threshold",
        "zclip-z-threshold": "zclip",
        "autoclip-percentile": "autoclip",
        "scaled-adam-clipping-scale": "scaled_adam",
    }
    assert all(r.stage == Stage.HISTORY for r in RULES if r.state_key)
    rule = RULE_BY_NAME["clip-grad-norm"]
    assert (rule.flag, rule.dest, rule.default) == ("--clip-grad-norm", "clip_grad_norm", 5.0)
    with pytest.raises(Exception):
        rule.default = 1.0  # frozen


def test_the_parser_group_has_one_flag_per_rule_with_the_tables_defaults():
    parser = argparse.ArgumentParser()
    add_gradient_control_arguments(parser)
    defaults = vars(parser.parse_args([]))
    assert defaults == {**{r.dest: r.default for r in RULES}, "grad_filter_mode": "soft"}
    for rule in RULES:
        for spelling in (rule.flag, *rule.aliases):
            assert getattr(parser.parse_args([spelling, "0.25"]), rule.dest) == 0.25, spelling
    assert parser.parse_args(["--grad-norm-threshold", "inf"]).grad_filter_threshold == math.inf
    assert parser.parse_args(["--grad-filter-mode", "uniform"]).grad_filter_mode == "uniform"
    # train.py's --help: every rule in the "gradient control" section, none with the model's flags.
    train = _train_parser()
    gradient, model = _help_section(train, "gradient control"), _help_section(train, "model")
    assert sorted(gradient) == sorted([*(s for r in RULES for s in (r.flag, *r.aliases)), "--grad-filter-mode"])
    assert "--model-preset" in model and not set(model) & set(gradient)
    for rule in RULES:
        assert " ".join(rule.help.split()[:6]) in " ".join(train.format_help().split()), rule.name


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_negative_or_nan_thresholds_are_refused_naming_the_flag(rule: Rule, capsys):
    parser = _train_parser()
    for value in ("-1", "nan"):
        with pytest.raises(SystemExit):
            check_gradient_control_args(parser, parser.parse_args([rule.flag, value]))
        assert f"{rule.flag} must be >= 0" in capsys.readouterr().err
    check_gradient_control_args(parser, parser.parse_args([rule.flag, str(rule.off)]))  # off is accepted


# --------------------------------------------------------------------------
# GradientControl
# --------------------------------------------------------------------------


def test_gradient_control_has_a_field_per_rule_it_applies():
    init_fields = [f for f, spec in GradientControl.__dataclass_fields__.items() if spec.init]
    assert sorted(init_fields) == sorted(r.dest for r in APPLIED_RULES)
    assert {r.name for r in RULES} == {r.name for r in APPLIED_RULES} | set(MODEL_RULES)


def test_from_params_of_an_earlier_run_leaves_its_missing_rules_off():
    # The params of a run from before ZClip, AutoClip, ScaledAdam's rule and the relative clip existed.
    earlier = dict(clip_grad_norm=5.0, clip_grad_value=0.5, agc_clipping=0.0, error_clip=0.0)
    control = GradientControl.from_params(earlier)
    assert (control.clip_grad_norm, control.clip_grad_value) == (5.0, 0.5)
    assert all(getattr(control, r.dest) == r.off for r in APPLIED_RULES if r.dest not in earlier)
    assert (control.relative_threshold, control.zclip, control.autoclip, control.scaled_adam) == (None,) * 4
    assert control.state_dict() == {}
    every = GradientControl.from_params({r.dest: 2.0 for r in RULES})
    assert all(getattr(every, r.dest) == 2.0 for r in APPLIED_RULES)


def test_state_dict_keys_are_the_tables_state_keys():
    control = GradientControl.from_params({r.dest: 2.0 for r in RULES})
    assert set(control.state_dict()) == {r.state_key for r in RULES if r.state_key}
    assert set(GradientControl(zclip_z_threshold=2.5).state_dict()) == {"zclip"}


def test_an_old_checkpoints_grad_control_state_loads():
    """The "grad_control" entry of a checkpoint written before the registry, in its format, restores each
    rule's history (and a resumed control then clips as the old one would)."""
    old = {
        "relative_threshold": {"norms": [1.0, 3.0, 2.0], "threshold": 4.0, "steps": 41},
        "zclip": {"buffer": [], "mean": 2.0, "var": 0.25},
        "autoclip": {"history": [1.0, 2.0, 3.0, 5.0]},
        "scaled_adam": {"step": 7, "model_norms": torch.arange(100.0), "threshold": 9.0, "param_rms": {"w": 0.5}},
    }
    control = GradientControl(
        clip_grad_norm_relative=2.0, zclip_z_threshold=2.5, autoclip_percentile=50.0, scaled_adam_clipping_scale=2.0
    )
    control.load_state_dict(old)
    state = control.state_dict()
    assert {k: v for k, v in state.items() if k != "scaled_adam"} == {k: old[k] for k in state if k != "scaled_adam"}
    assert torch.equal(state["scaled_adam"]["model_norms"], old["scaled_adam"]["model_norms"])
    assert state["scaled_adam"]["step"] == 7 and state["scaled_adam"]["param_rms"] == {"w": 0.5}
    assert float(control.autoclip.update(4.0)) == 3.0  # the median of the loaded history and this norm: 1, 2, 3, 4, 5
    assert control.relative_threshold.state_dict()["threshold"] == 4.0 and control.zclip.mean == 2.0


def _one_parameter(grad: List[float]) -> nn.Module:
    model = nn.Module()
    model.w = nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    model.w.grad = torch.tensor(grad, dtype=torch.float64)
    return model


def test_after_backward_rules_apply_in_the_tables_order_by_hand():
    """w = [1, 1], grad [3, -0.5]: value 1 -> [1, -0.5]; AGC 0.5 (unit = the whole vector, |w| = sqrt 2)
    -> scaled to 0.5 sqrt 2; the norm clip 0.5 -> scaled to 0.5. Another order gives other numbers."""
    model = _one_parameter([3.0, -0.5])
    norm, scale = map(float, GradientControl(clip_grad_value=1.0, agc_clipping=0.5, clip_grad_norm=0.5).clip(model))
    after_value = [1.0, -0.5]
    value_norm = math.sqrt(1.0 + 0.25)
    agc_max = 0.5 * math.sqrt(2.0)
    after_agc = [g * agc_max / value_norm for g in after_value]
    after_norm = [g * 0.5 / (agc_max + 1e-6) for g in after_agc]
    torch.testing.assert_close(model.w.grad, torch.tensor(after_norm, dtype=torch.float64), rtol=1e-6, atol=0)
    assert norm == pytest.approx(math.sqrt(9.25), rel=1e-12)
    assert scale == pytest.approx(math.hypot(*after_norm) / math.sqrt(9.25), rel=1e-6)


def test_history_rules_see_the_norm_after_the_element_wise_rules_by_hand():
    """AutoClip at the 50th percentile after clipping by value 1: step 1's norm sqrt(0.5) is its own median
    (not clipped); step 2's [3, 0.5] is [1, 0.5] after the value clip, norm sqrt(1.25), clipped to the
    midpoint of sqrt(0.5) and sqrt(1.25) (the raw norm sqrt(9.25) is not what AutoClip records)."""
    control = GradientControl(clip_grad_value=1.0, autoclip_percentile=50.0)
    first = _one_parameter([0.5, 0.5])
    assert float(control.clip(first)[1]) == 1.0 and torch.equal(
        first.w.grad, torch.tensor([0.5, 0.5], dtype=torch.float64)
    )
    second = _one_parameter([3.0, 0.5])
    control.clip(second)
    factor = (math.sqrt(0.5) + math.sqrt(1.25)) / 2 / (math.sqrt(1.25) + 1e-6)
    torch.testing.assert_close(
        second.w.grad, torch.tensor([1.0 * factor, 0.5 * factor], dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert control.autoclip.history == pytest.approx([math.sqrt(0.5), math.sqrt(1.25)])


# --------------------------------------------------------------------------
# The model's wiring
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", GRAD_FILTER_MODES)
def test_the_filters_mode_and_the_recurrent_cap_reach_every_layer_at_build_time(mode, monkeypatch):
    built: List[Dict[str, object]] = []
    original_init = GradientFilter.__init__

    def recording_init(self, batch_dim, threshold, mode="soft"):
        built.append({"threshold": threshold, "mode": mode})
        original_init(self, batch_dim, threshold, mode)

    def refuse_setattr(self, name, value):  # nothing sets the mode once a filter is built
        if name == "mode" and "mode" in self.__dict__:
            raise AssertionError("the filter's mode was set after it was built")
        nn.Module.__setattr__(self, name, value)

    monkeypatch.setattr(GradientFilter, "__init__", recording_init)
    monkeypatch.setattr(GradientFilter, "__setattr__", refuse_setattr)
    parser = _train_parser()
    args = parser.parse_args(
        ["--grad-filter-mode", mode, "--grad-filter-threshold", "7", "--recurrent-grad-clip", "30"]
        + ["--num-encoder-layers", "3", "--encoder-dim", "16", "--rnn-hidden-size", "16"]
    )
    model = build_transducer(**training_model_config(args, vocab_size=12, blank_id=0))
    assert built == [{"threshold": 7.0, "mode": mode}] * 3
    assert [f.mode for _, f in model.encoder.gradient_filters()] == [mode] * 3
    lstms = [m for m in model.modules() if isinstance(m, ScaledLSTM)]
    assert [m.recurrent_grad_clip for m in lstms] == [30.0] * 3


def test_a_decoding_model_has_no_filter_and_loads_a_trained_checkpoint():
    """decode.py and export_onnx.py build without the filter (it acts only in backward, has no state): the
    weights of a model trained with it load strictly and give the same outputs."""
    torch.manual_seed(0)
    trained = tiny_transducer(grad_filter_mode="uniform", dropout=0.0, layer_dropout=0.0)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    sizes = {k: v for k, v in TINY_TRANSDUCER.items() if k in MODEL_PRESETS["cpu"]}
    args = parser.parse_args([item for k, v in sizes.items() for item in (f"--{k.replace('_', '-')}", str(v))])
    config = model_config_from_args(args, vocab_size=12, blank_id=0, num_features=80)
    assert config["grad_filter_threshold"] == 0.0 and "grad_filter_mode" not in config
    decoding = build_transducer(**config)
    assert decoding.encoder.gradient_filters() == [] and len(trained.encoder.gradient_filters()) == 2
    decoding.load_state_dict(trained.state_dict())  # strict
    x = torch.randn(2, 40, 80)
    with torch.no_grad():
        a = trained.eval().encoder(x, torch.tensor([40, 31]))[0]
        b = decoding.eval().encoder(x, torch.tensor([40, 31]))[0]
    assert torch.equal(a, b)


# --------------------------------------------------------------------------
# The uniform filter
# --------------------------------------------------------------------------


def _uniform_by_hand(x_grad: Tensor, param_grads: List[Tensor], threshold: float) -> List[Tensor]:
    """The uniform filter's gradients by its definition, in float64, sequences on dim 1: every sequence's
    gradient times the mean over the sequences of the soft filter's c / (c + n_b), every parameter's times
    1 / (1 + mean(n) / c), where n_b is sequence b's gradient RMS and c = threshold x their median."""
    g = x_grad.double()
    n = torch.stack([g[:, b].square().mean().sqrt() for b in range(g.size(1))])
    c = n.median() * threshold
    return [g * (c / (c + n)).mean(), *(p.double() / (1.0 + n.mean() / c) for p in param_grads)]


def _filtered_grads(grad_filter: nn.Module, x: Tensor, params: List[Tensor], out_grads: List[Tensor]):
    x = x.clone().requires_grad_()
    params = [p.clone().requires_grad_() for p in params]
    outs = grad_filter(x, *params)
    torch.autograd.backward(list(outs), out_grads)
    return [x.grad, *(p.grad for p in params)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("threshold", [0.5, 2.0, 25.0])
def test_uniform_mode_scales_every_sequence_by_the_soft_filters_mean_factor(seed, threshold):
    """Against the definition worked in float64 (the library's mode was also checked bit for bit against the
    study's former UniformGradientFilter: the same 40-batch model checksum, 2026-11-28)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 5, 3, generator=gen)
    params = [torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)]
    spread = torch.logspace(-2, 2, 5).view(1, 5, 1)[:, torch.randperm(5, generator=gen)]
    out_grads = [torch.randn(7, 5, 3, generator=gen) * spread, *(torch.randn_like(p) for p in params)]
    ours = GradientFilter(batch_dim=1, threshold=threshold, mode="uniform")
    got = _filtered_grads(ours, x, params, out_grads)
    for g, want in zip(got, _uniform_by_hand(out_grads[0], out_grads[1:], threshold)):
        torch.testing.assert_close(g.double(), want, rtol=1e-6, atol=0.0)
    assert 0 < ours.stats.as_dict()["param_scale"] < 1


def test_uniform_mode_in_an_lstm_and_its_edge_cases():
    """A ScaledLSTM built with mode uniform carries a uniform filter, which acts in its backward (a parameter
    scale below 1 at this spread of sequence gradients); a zero median gradient and an infinite threshold
    (observing) leave gradients untouched."""
    torch.manual_seed(0)
    lstm = ScaledLSTM(6, 8, proj_size=4, grad_filter_threshold=3.0, grad_filter_mode="uniform")
    assert lstm.grad_filter.mode == "uniform"
    x = torch.randn(9, 5, 6)
    out_grad = torch.randn(9, 5, 4) * torch.tensor([0.1, 1.0, 1.0, 1.2, 40.0]).view(1, 5, 1)
    x_in = x.clone().requires_grad_()
    (lstm(x_in)[0] * out_grad).sum().backward()
    assert 0 < lstm.grad_filter.stats.as_dict()["param_scale"] < 1
    zero = GradientFilter(1, 3.0, mode="uniform")
    grads = _filtered_grads(zero, x, [torch.ones(2)], [torch.zeros_like(x), torch.full((2,), 3.0)])
    assert torch.equal(grads[1], torch.full((2,), 3.0))  # a zero median filters nothing, as the soft filter
    observing = GradientFilter(1, math.inf, mode="uniform")
    grads = _filtered_grads(observing, x, [torch.ones(2)], [out_grad[..., :1].expand(9, 5, 6), torch.ones(2)])
    assert torch.equal(grads[0], out_grad[..., :1].expand(9, 5, 6)) and torch.equal(grads[1], torch.ones(2))
    assert observing.stats.as_dict()["max_over_median"] > 1
