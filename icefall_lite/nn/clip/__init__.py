"""Gradient control: every clipping flavour users know, in one package, a module for each place a rule
acts (train.py's rules and their stages: :mod:`icefall_lite.train.rules`):

- in backward: :mod:`~icefall_lite.nn.clip.filter` (icefall's GradientFilter, in every LSTM layer) and
  :mod:`~icefall_lite.nn.clip.in_backward` (Paddle's error clip, Kaldi's recurrent cap);
- after backward: :mod:`~icefall_lite.nn.clip.after_backward` (global norm, value, AGC);
- from the norm's history: :mod:`~icefall_lite.nn.clip.history` (running median, ZClip, AutoClip,
  ScaledAdam's rule).

Every public name is importable from here.
"""

from icefall_lite.nn.clip.after_backward import (
    NonFiniteGradientError,
    ParamsLike,
    adaptive_clip_grad_,
    clip_grad_norm_,
    clip_grad_value_,
    clip_scale_above,
    get_total_norm,
    norm_clip_scale,
    per_tensor_norms,
    scale_grads_,
    unitwise_norm,
)
from icefall_lite.nn.clip.filter import (
    GRAD_FILTER_MODES,
    GradientFilter,
    GradientFilterStats,
    check_grad_filter_mode,
)
from icefall_lite.nn.clip.history import (
    AutoClipThreshold,
    RunningMedianThreshold,
    ScaledAdamClipping,
    ZClipThreshold,
    percentile_linear,
)
from icefall_lite.nn.clip.in_backward import (
    ClipCounts,
    ErrorClipByValue,
    add_error_clip,
    error_clip,
    recurrent_grad_clip,
)

__all__ = [
    "GRAD_FILTER_MODES",
    "AutoClipThreshold",
    "ClipCounts",
    "ErrorClipByValue",
    "GradientFilter",
    "GradientFilterStats",
    "NonFiniteGradientError",
    "ParamsLike",
    "RunningMedianThreshold",
    "ScaledAdamClipping",
    "ZClipThreshold",
    "adaptive_clip_grad_",
    "add_error_clip",
    "check_grad_filter_mode",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_scale_above",
    "error_clip",
    "get_total_norm",
    "norm_clip_scale",
    "per_tensor_norms",
    "percentile_linear",
    "recurrent_grad_clip",
    "scale_grads_",
    "unitwise_norm",
]
