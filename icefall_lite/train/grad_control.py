"""Gradient control during training: each kind named by what it is, one flag each.

=========================  ==================================================  ================================
flag                       what it does                                        where it acts
=========================  ==================================================  ================================
``--grad-filter-threshold``  icefall's GradientFilter in every LSTM layer       in backward (a model flag:
  (``--grad-norm-threshold``)                                                   :func:`add_model_arguments`)
``--error-clip``           Paddle's ErrorClipByValue on every encoder layer's  in backward
                           output gradient
``--recurrent-grad-clip``  Kaldi's per-frame cap on the derivative along every  in backward (inside the LSTMs)
                           LSTM's recurrence (BackpropTruncationComponent)
``--clip-grad-value``      clamp every gradient element to [-v, v]             after backward
``--agc-clipping``         unit-wise adaptive clipping (AGC), lambda           after backward
``--clip-grad-norm``       scale all gradients to a global L2 norm <= max      after backward (last)
``--clip-grad-norm-relative``  the same, max = S x the running median of the    after backward (last)
                           pre-clip global norm (an approximation of icefall
                           ScaledAdam's rule on the raw norm)
``--zclip-z-threshold``    ZClip: the global norm clipped when its z-score     after backward (last)
                           against EMAs of its mean and variance exceeds Z
``--autoclip-percentile``  AutoClip: the global norm clipped at the P-th        after backward (last)
                           percentile of all its past values
``--scaled-adam-clipping-scale``  icefall ScaledAdam's rule, exactly: the norm   after backward (last)
                           of the gradients each times its parameter's RMS,
                           clipped at S x the median of the last 100 such
                           norms (re-estimated every 100 steps)
=========================  ==================================================  ================================

The flags combine; after backward they apply in the order of the table (with
several global-norm rules on, the smallest scale wins). The relative clip tells
"normalises every step" (a fixed maximum below the typical norm) from "catches
the rare outlier" (a maximum that follows the typical norm). The rules that
follow the history of the norm (relative, ZClip, AutoClip, ScaledAdam's) keep state that checkpoints
keep (:meth:`GradientControl.state_dict`), each its own history as if it were
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
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from icefall_lite.nn.clip import (
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
from icefall_lite.nn.scaling import ScaledLSTM
from icefall_lite.train.checkpoint import unwrap

# AGC leaves the final classifier layer unclipped (Brock et al. 2021): the joiner's output layer.
AGC_EXCLUDED = "output_linear"
FLAGS = (
    "clip_grad_norm",
    "clip_grad_value",
    "agc_clipping",
    "error_clip",
    "clip_grad_norm_relative",
    "zclip_z_threshold",
    "autoclip_percentile",
    "scaled_adam_clipping_scale",
    "recurrent_grad_clip",
)
# The relative clip re-estimates its median every this many steps (as ScaledAdam's clipping_update_period).
RELATIVE_CLIP_UPDATE_PERIOD = 100


def add_gradient_control_arguments(parser: argparse.ArgumentParser) -> None:
    """The clipping flags of train.py (the filter's flag is a model flag)."""
    group = parser.add_argument_group("gradient control")
    group.add_argument(
        "--clip-grad-norm",
        type=float,
        default=5.0,
        help="Scale all gradients together so that their global L2 norm is at most this; 0 = off.",
    )
    group.add_argument(
        "--clip-grad-value", type=float, default=0.0, help="Clamp every gradient element to [-VALUE, VALUE]; 0 = off."
    )
    group.add_argument(
        "--agc-clipping",
        type=float,
        default=0.0,
        help="Adaptive gradient clipping (AGC): lambda, the largest allowed unit-wise ratio of "
        "gradient norm to weight norm (the joiner's output layer is left unclipped); 0 = off.",
    )
    group.add_argument(
        "--clip-grad-norm-relative",
        type=float,
        default=0.0,
        help="Scale all gradients together so that their global L2 norm is at most S times the median of "
        f"the recent pre-clip norms (icefall's ScaledAdam rule: re-estimated at steps 10, 20, 40, then every "
        f"{RELATIVE_CLIP_UPDATE_PERIOD}; none before step 10); 0 = off.",
    )
    group.add_argument(
        "--zclip-z-threshold",
        type=float,
        default=0.0,
        help="ZClip (Kumar et al. 2025; its authors' default 'zscore' / 'adaptive_scaling' variant): EMAs "
        "(alpha 0.97) of the mean and variance of the global norm, started from the first 25 norms (not "
        "clipped); a norm whose z-score exceeds Z is clipped to mean + Z^2 std / z, and the EMAs are updated "
        "with the clipped norm. The authors recommend 2.5; 0 = off.",
    )
    group.add_argument(
        "--autoclip-percentile",
        type=float,
        default=0.0,
        help="AutoClip (Seetharaman et al. 2020): clip the global norm at the P-th percentile (0 < P <= 100; "
        "numpy's linear interpolation) of every global norm so far, this step's included. The authors "
        "recommend 10; 0 = off.",
    )
    group.add_argument(
        "--scaled-adam-clipping-scale",
        type=float,
        default=0.0,
        help="icefall ScaledAdam's gradient clipping, exactly, with any optimizer: the norm of the gradients "
        "each multiplied by its parameter's RMS (one-element parameters by 0.1) is clipped at S times the "
        "median of the last 100 such norms, re-estimated every 100 steps (and at steps 10, 20, 40 at twice "
        "that; none before step 10). The zipformer recipes use 2.0; 0 = off. (--clip-grad-norm-relative is "
        "the same idea on the raw norm.)",
    )
    group.add_argument(
        "--recurrent-grad-clip",
        type=float,
        default=0.0,
        help="Kaldi nnet3's per-frame derivative cap (BackpropTruncationComponent, clipping-threshold 30 in its "
        "LSTM recipes): in every LSTM layer, the derivative that flows back from frame t+1 into the state "
        "[h_t, c_t] is scaled, for each frame of each sequence, to an L2 norm of at most this. The LSTMs then "
        "run frame by frame in training (slower); 0 = off (the fused kernel).",
    )
    group.add_argument(
        "--error-clip",
        type=float,
        default=0.0,
        help="Per-variable error clip (Paddle's ErrorClipByValue) during backward: the gradient "
        "arriving at every encoder layer's output is clamped element-wise to [-VALUE, VALUE] "
        "before it flows into the layer; 0 = off.",
    )


def check_gradient_control_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An argparse error naming the flag for a negative (or NaN) threshold."""
    for name in FLAGS:
        value = getattr(args, name)
        if not value >= 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.scaled_adam_clipping_scale > 0 and getattr(args, "optimizer_name", None) == "scaled-adam":
        parser.error(
            "--scaled-adam-clipping-scale: --optimizer scaled-adam clips by its own rule already "
            "(clipping_scale 2.0); use one of them"
        )
    if getattr(args, "use_fp16", False):
        for name in ("error_clip", "recurrent_grad_clip"):
            if getattr(args, name) > 0:
                parser.error(
                    f"--{name.replace('_', '-')} with --use-fp16: its absolute threshold would act in backward on "
                    f"the GradScaler's scaled gradient (the scale changes as training goes); use it in float32 or "
                    f"with --use-bf16"
                )
    if args.autoclip_percentile > 100:
        parser.error(f"--autoclip-percentile must be at most 100 (a percentile), got {args.autoclip_percentile}")


@dataclass
class GradientControl:
    """The clipping of a run; 0 switches a kind off (see the module doc)."""

    clip_grad_norm: float
    clip_grad_value: float
    agc_clipping: float
    error_clip: float
    clip_grad_norm_relative: float
    zclip_z_threshold: float = 0.0
    autoclip_percentile: float = 0.0
    scaled_adam_clipping_scale: float = 0.0
    recurrent_grad_clip: float = 0.0
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
        """The rules that keep a history, by their key in :meth:`state_dict` (those that are on)."""
        rules = {
            "relative_threshold": self.relative_threshold,
            "zclip": self.zclip,
            "autoclip": self.autoclip,
            "scaled_adam": self.scaled_adam,
        }
        return {key: rule for key, rule in rules.items() if rule is not None}

    def state_dict(self) -> Dict[str, Any]:
        """The histories of the rules that keep one (empty without them)."""
        return {key: rule.state_dict() for key, rule in self._stateful().items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, rule in self._stateful().items():
            if key in state:
                rule.load_state_dict(state[key])

    def _max_norm(self, norm: float) -> Optional[float]:
        """This step's maximum global norm of the fixed and relative clips (None: neither); records ``norm``
        for the relative clip."""
        limits = [self.clip_grad_norm] if self.clip_grad_norm > 0 else []
        if self.relative_threshold is not None:
            threshold = self.relative_threshold.update(norm)
            if threshold is not None:
                limits.append(threshold)
        return min(limits) if limits else None

    def _history_scale(self, norm: float, model: nn.Module) -> float:
        """The factor of the rules that follow the norm's history (1: none on, or none clips); records
        ``norm``, the global norm at their stage (ScaledAdam's rule its own norm of ``model``'s gradients)."""
        scale = 1.0
        if self.scaled_adam is not None:
            trained = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
            scale = min(scale, self.scaled_adam.scale(trained))
        if self.zclip is not None:
            target = self.zclip.update(norm)
            if target is not None:
                scale = min(scale, clip_scale_above(norm, target))
        if self.autoclip is not None:
            scale = min(scale, clip_scale_above(norm, self.autoclip.update(norm)))
        return scale

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "GradientControl":
        """The control of train.py's flags in ``params``; a flag they lack (the parameters of a run from
        before it existed) is off."""
        return cls(**{name: float(params.get(name, 0.0)) for name in FLAGS})

    def install(self, model: nn.Module) -> None:
        """The in-backward kinds (when on): the error clip on every encoder layer's output (the elements it
        changes counted per layer in :attr:`error_clip_counts`), the recurrent derivative cap in every
        ScaledLSTM."""
        if self.recurrent_grad_clip > 0:
            lstms = [m for m in unwrap(model).modules() if isinstance(m, ScaledLSTM)]
            for lstm in lstms:
                lstm.recurrent_grad_clip = self.recurrent_grad_clip
            logging.info(f"Recurrent derivative cap {self.recurrent_grad_clip:g} in {len(lstms)} LSTM layers")
        if self.error_clip <= 0:
            return
        clip = ErrorClipByValue(self.error_clip)
        layers = unwrap(model).encoder.encoder.layers
        self.error_clip_counts = [ClipCounts() for _ in layers]
        for layer, counts in zip(layers, self.error_clip_counts):
            add_error_clip(layer, clip, counts)
        logging.info(f"Error clip {clip} on the outputs of {len(layers)} encoder layers")

    def clip(self, model: nn.Module) -> Tuple[float, float]:
        """Apply the after-backward kinds to the gradients of ``model``.

        Returns:
          (pre-clip global L2 norm, clip scale = post- / pre-clip norm). A
          non-finite norm is returned as is, with nothing clipped (the caller
          skips the step).
        """
        named = [(n, p) for n, p in unwrap(model).named_parameters() if p.grad is not None]
        grads: List = [p.grad for _, p in named]
        norm = get_total_norm(grads)
        if not math.isfinite(float(norm)):
            return float(norm), 1.0
        if self.clip_grad_value > 0:
            clip_grad_value_(named, self.clip_grad_value)
        if self.agc_clipping > 0:
            adaptive_clip_grad_(named, self.agc_clipping, exclude=[n for n, _ in named if AGC_EXCLUDED in n])
        elementwise = self.clip_grad_value > 0 or self.agc_clipping > 0
        max_norm = self._max_norm(float(norm))
        history = self.zclip is not None or self.autoclip is not None or self.scaled_adam is not None
        if max_norm is None and not history:
            if not elementwise:
                return float(norm), 1.0
            after = float(get_total_norm(grads))
            return float(norm), after / float(norm) if float(norm) > 0 else 1.0
        current = get_total_norm(grads) if elementwise else norm
        scale = norm_clip_scale(current, max_norm) if max_norm is not None else None
        if history:
            rule_scale = self._history_scale(float(current), model)
            if rule_scale < 1.0:
                scale = torch.clamp(scale, max=rule_scale) if scale is not None else torch.tensor(rule_scale)
        if scale is not None:
            scale_grads_(grads, scale)
        if not elementwise:
            return float(norm), 1.0 if scale is None else float(scale)
        after = float(get_total_norm(grads))
        return float(norm), after / float(norm) if float(norm) > 0 else 1.0
