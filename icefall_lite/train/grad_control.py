"""Gradient control during training: the rules of :data:`icefall_lite.train.rules.RULES`, one flag each.

The table says what each rule does and where it acts; this module derives
train.py's "gradient control" argument group and its validation from it, and
applies the rules that act on the gradients after backward
(:meth:`GradientControl.clip`) and the error clip, a hook on the built model
(:meth:`GradientControl.install`). The GradientFilter and the recurrent cap are
parts of the model, built with it (:data:`MODEL_RULES`,
:func:`icefall_lite.train.setup.training_model_config`).

The flags combine; after backward they apply in the order of the table (with
several global-norm rules on, the smallest scale wins). The relative clip tells
"normalises every step" (a fixed maximum below the typical norm) from "catches
the rare outlier" (a maximum that follows the typical norm). The rules that
follow the history of the norm (relative, ZClip, AutoClip, ScaledAdam's) keep state that checkpoints
keep (:meth:`GradientControl.state_dict`, by each rule's ``state_key``), each its own history as if it were
alone. The relative clip records the pre-clip norm (before value and AGC
clipping); the later rules see the gradients at the global stage, after the
element-wise kinds (the same norm when those are off).
:meth:`GradientControl.clip` returns the pre-clip global norm and the clip
scale (post- over pre-clip norm), which the training loop logs for every kind
alike.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.nn.clip import (
    GRAD_FILTER_MODES,
    AutoClipThreshold,
    ClipCounts,
    ErrorClipByValue,
    RunningMedianThreshold,
    ScaledAdamClipping,
    ZClipThreshold,
    adaptive_clip_grad_,
    add_error_clip,
    clip_grad_value_,
    clip_scale_above,
    get_total_norm,
    norm_clip_scale,
    scale_grads_,
)
from icefall_lite.train.checkpoint import unwrap
from icefall_lite.train.rules import RELATIVE_CLIP_UPDATE_PERIOD, RULE_BY_NAME, RULES

# AGC leaves the final classifier layer unclipped (Brock et al. 2021): the joiner's output layer.
AGC_EXCLUDED = "output_linear"
# The rules built into the model (the GradientFilter in every LSTM layer, the recurrent cap along every LSTM's
# recurrence): :func:`icefall_lite.train.setup.training_model_config` passes them to build_transducer.
MODEL_RULES = ("grad-filter-threshold", "recurrent-grad-clip")
# The rules whose threshold is absolute and acts in backward, where --use-fp16's loss scale multiplies the
# gradient (the filter's threshold is relative to the batch's median, so a common scale does not move it).
ABSOLUTE_IN_BACKWARD = ("error-clip", "recurrent-grad-clip")
# The rules GradientControl applies: its fields.
APPLIED_RULES = tuple(rule for rule in RULES if rule.name not in MODEL_RULES)
GRAD_FILTER_MODE_HELP = (
    "How the GradientFilter acts on the sequences above its cutoff: soft (icefall's: every sequence's "
    "gradient scaled by c / (c + n), the LSTM's weight gradients by 1 / (1 + mean(n) / c)), hard-mask "
    "(the sequences above the cutoff dropped from the LSTM's gradients, every other gradient untouched) or "
    "uniform (every sequence's gradient scaled by the mean of soft's factors, the weight gradients as soft: "
    "soft's shrinking without its per-sequence capping)."
)


def add_gradient_control_arguments(parser: argparse.ArgumentParser) -> None:
    """train.py's "gradient control" group: one flag per rule of :data:`RULES` (its default and help from
    the table), and the filter's ``--grad-filter-mode`` after the filter's threshold."""
    group = parser.add_argument_group("gradient control")
    for rule in RULES:
        group.add_argument(rule.flag, *rule.aliases, dest=rule.dest, type=float, default=rule.default, help=rule.help)
        if rule.name == "grad-filter-threshold":
            group.add_argument(
                "--grad-filter-mode", choices=GRAD_FILTER_MODES, default="soft", help=GRAD_FILTER_MODE_HELP
            )


def check_gradient_control_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argparse error naming the flag for a negative (or NaN) threshold, or a combination that cannot work."""
    for rule in RULES:
        value = getattr(args, rule.dest)
        if not value >= 0:
            parser.error(f"{rule.flag} must be >= 0, got {value}")
    if args.scaled_adam_clipping_scale > 0 and getattr(args, "optimizer_name", None) == "scaled-adam":
        parser.error(
            "--scaled-adam-clipping-scale: --optimizer scaled-adam clips by its own rule already "
            "(clipping_scale 2.0); use one of them"
        )
    if getattr(args, "use_fp16", False):
        for name in ABSOLUTE_IN_BACKWARD:
            if getattr(args, RULE_BY_NAME[name].dest) > 0:
                parser.error(
                    f"--{name} with --use-fp16: its absolute threshold would act in backward on "
                    f"the GradScaler's scaled gradient (the scale changes as training goes); use it in float32 or "
                    f"with --use-bf16"
                )
    if args.autoclip_percentile > 100:
        parser.error(f"--autoclip-percentile must be at most 100 (a percentile), got {args.autoclip_percentile}")


@dataclass
class GradientControl:
    """The gradient control of a run, but for the rules built into the model (:data:`MODEL_RULES`): one field
    per rule of :data:`RULES`, by its dest; 0 switches a rule off (see the module doc). The rules that keep a
    history have it in the attribute named by their ``state_key``."""

    error_clip: float = 0.0
    clip_grad_value: float = 0.0
    agc_clipping: float = 0.0
    clip_grad_norm: float = 0.0
    clip_grad_norm_relative: float = 0.0
    zclip_z_threshold: float = 0.0
    autoclip_percentile: float = 0.0
    scaled_adam_clipping_scale: float = 0.0
    relative_threshold: Optional[RunningMedianThreshold] = field(init=False, default=None)
    zclip: Optional[ZClipThreshold] = field(init=False, default=None)
    autoclip: Optional[AutoClipThreshold] = field(init=False, default=None)
    scaled_adam: Optional[ScaledAdamClipping] = field(init=False, default=None)
    error_clip_counts: List[ClipCounts] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.clip_grad_norm_relative > 0:
            self.relative_threshold = RunningMedianThreshold(self.clip_grad_norm_relative, RELATIVE_CLIP_UPDATE_PERIOD)
        if self.zclip_z_threshold > 0:
            self.zclip = ZClipThreshold(self.zclip_z_threshold)
        if self.autoclip_percentile > 0:
            self.autoclip = AutoClipThreshold(self.autoclip_percentile)
        if self.scaled_adam_clipping_scale > 0:
            self.scaled_adam = ScaledAdamClipping(self.scaled_adam_clipping_scale)

    def _stateful(self) -> Dict[str, Any]:
        """The rules that keep a history, by their ``state_key`` (those that are on)."""
        rules = {rule.state_key: getattr(self, rule.state_key) for rule in RULES if rule.state_key is not None}
        return {key: rule for key, rule in rules.items() if rule is not None}

    def state_dict(self) -> Dict[str, Any]:
        """The histories of the rules that keep one (empty without them)."""
        return {key: rule.state_dict() for key, rule in self._stateful().items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, rule in self._stateful().items():
            if key in state:
                rule.load_state_dict(state[key])

    def _max_norm(self, norm: Tensor, skip: Tensor) -> Union[None, float, Tensor]:
        """This step's maximum global norm of the fixed and relative clips (None: neither is on; with the
        relative clip a 0-dim float64 tensor, inf before its first threshold); records ``norm`` for the
        relative clip unless ``skip``."""
        if self.relative_threshold is None:
            return self.clip_grad_norm if self.clip_grad_norm > 0 else None
        threshold = self.relative_threshold.update(norm, skip)
        return torch.clamp(threshold, max=self.clip_grad_norm) if self.clip_grad_norm > 0 else threshold

    def _history_scale(self, norm: Tensor, skip: Tensor, model: nn.Module) -> Tensor:
        """The factor of the rules that follow the norm's history as a 0-dim float64 tensor (1: none clips);
        records ``norm``, the global norm at their stage (ScaledAdam's rule its own norm of ``model``'s
        gradients), unless ``skip``."""
        norm = norm.to(torch.float64)
        scale = torch.ones((), dtype=torch.float64, device=norm.device)
        if self.scaled_adam is not None and not bool(skip):  # ScaledAdam's rule reads its norm on the host
            trained = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
            scale = torch.clamp(scale, max=self.scaled_adam.scale(trained))
        if self.zclip is not None:
            scale = torch.minimum(scale, clip_scale_above(norm, self.zclip.update(norm, skip)))
        if self.autoclip is not None:
            scale = torch.minimum(scale, clip_scale_above(norm, self.autoclip.update(norm, skip)))
        return scale

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "GradientControl":
        """The control of train.py's flags in ``params``; a flag they lack (the parameters of a run from
        before it existed) is off."""
        return cls(**{rule.dest: float(params.get(rule.dest, rule.off)) for rule in APPLIED_RULES})

    def install(self, model: nn.Module) -> None:
        """The error clip (when on) on every encoder layer's output, the elements it changes counted per layer
        in :attr:`error_clip_counts`.

        A hook on the built model rather than a part of it: it clips the gradient of a variable (each layer's
        output) during backward, whatever the module computing it; the model's own in-backward rules (the
        filter, the recurrent cap) act inside its LSTMs and are built with it.
        """
        if self.error_clip <= 0:
            return
        clip = ErrorClipByValue(self.error_clip)
        layers = unwrap(model).encoder.encoder.layers
        self.error_clip_counts = [ClipCounts() for _ in layers]
        for layer, counts in zip(layers, self.error_clip_counts):
            add_error_clip(layer, clip, counts)
        logging.info(f"Error clip {clip} on the outputs of {len(layers)} encoder layers")

    def clip(self, model: nn.Module) -> Tuple[Tensor, Tensor]:
        """Apply the after-backward kinds to the gradients of ``model``, without a host read (but ScaledAdam's
        rule's, :meth:`_history_scale`).

        Returns:
          (pre-clip global L2 norm, clip scale = post- / pre-clip norm), 0-dim
          device tensors (the norm in the gradients' accumulation dtype, the
          scale in float64). A non-finite norm (the caller's found-inf flag:
          the step is skipped) leaves every gradient and every rule's history
          as it is, with the scale 1.
        """
        named = [(n, p) for n, p in unwrap(model).named_parameters() if p.grad is not None]
        grads: List = [p.grad for _, p in named]
        norm = get_total_norm(grads)
        skip = ~torch.isfinite(norm)
        one = torch.ones((), dtype=torch.float64, device=norm.device)
        if self.clip_grad_value > 0:
            clip_grad_value_(named, self.clip_grad_value, skip=skip)
        if self.agc_clipping > 0:
            excluded = [n for n, _ in named if AGC_EXCLUDED in n]
            adaptive_clip_grad_(named, self.agc_clipping, exclude=excluded, skip=skip)
        elementwise = self.clip_grad_value > 0 or self.agc_clipping > 0
        max_norm = self._max_norm(norm, skip)
        history = self.zclip is not None or self.autoclip is not None or self.scaled_adam is not None
        if max_norm is not None or history:
            current = get_total_norm(grads) if elementwise else norm
            scale = norm_clip_scale(current, max_norm) if max_norm is not None else None
            if history:
                # The history's factor (float64) is rounded to the gradients' dtype where the two meet.
                rule_scale = self._history_scale(current, skip, model).to(current.dtype)
                scale = rule_scale if scale is None else torch.minimum(scale, rule_scale)
            scale = torch.where(skip, 1.0, scale)
            scale_grads_(grads, scale)
            if not elementwise:
                return norm, scale.to(torch.float64)
        elif not elementwise:
            return norm, one
        # The scale as Python divided the two norms: in float64.
        after, before = get_total_norm(grads).to(torch.float64), norm.to(torch.float64)
        return norm, torch.where(skip | (before <= 0), one, after / before)
