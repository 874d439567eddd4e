"""Thresholds that follow the history of the global gradient norm, each with a ``state_dict`` so that a
resumed run clips as the uninterrupted one:

- :class:`RunningMedianThreshold`: a multiple of the running median of the raw norm;
- :class:`ZClipThreshold`: ZClip's z-score rule;
- :class:`AutoClipThreshold`: AutoClip's percentile of every past norm;
- :class:`ScaledAdamClipping`: icefall ScaledAdam's rule, exactly.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from icefall_lite.nn.clip.after_backward import per_tensor_norms

Tensor = torch.Tensor


class RunningMedianThreshold:
    """A clipping threshold relative to the recent gradient norms: ``scale`` times their median.

    Modelled on icefall ScaledAdam's ``clipping_scale`` rule, on the norm it is
    given (``--clip-grad-norm-relative`` gives the raw global norm): every
    step's norm is recorded (the last ``update_period`` kept); the threshold
    is re-estimated at steps 10, 20 and 40 and then every ``update_period``
    steps from the norms recorded so far; before step 10 there is none. It
    carries its own ``state_dict`` so that a resumed run clips as the
    uninterrupted one.

    It is an approximation, kept as it is because the ablation's committed
    runs (and this project's ``ScaledAdam``) use it. icefall's own rule,
    exactly, is :class:`ScaledAdamClipping`; this one differs in that it
    takes any norm (icefall's weights each gradient by its parameter's RMS),
    records step 0 (icefall neither records nor clips it), takes the upper
    median ``sorted[n // 2]`` (icefall ``sorted[(n // 4) * 2]``: not the same
    for 10 norms) and does not double the threshold at steps 10, 20 and 40
    (icefall does, "as norm may be changing rapidly").
    """

    def __init__(self, scale: float, update_period: int) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if update_period < 1:
            raise ValueError(f"update_period must be >= 1, got {update_period}")
        self.scale = scale
        self.update_period = update_period
        self.norms: List[float] = []
        self.threshold: Optional[float] = None
        self.steps = 0

    def update(self, norm: float) -> Optional[float]:
        """Record this step's ``norm``; the threshold for this step (None: no clipping yet)."""
        self.norms = (self.norms + [norm])[-self.update_period :]
        step = self.steps
        if step in (10, 20, 40) or (step > 0 and step % self.update_period == 0):
            recent = sorted(self.norms[-step:])
            self.threshold = self.scale * recent[len(recent) // 2]
        self.steps += 1
        return self.threshold

    def state_dict(self) -> Dict[str, Any]:
        return {"norms": list(self.norms), "threshold": self.threshold, "steps": self.steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.norms = list(state["norms"])
        self.threshold = state["threshold"]
        self.steps = int(state["steps"])


class ZClipThreshold:
    """ZClip (Kumar et al. 2025, arXiv 2504.02507): clip the global norm when its z-score is an outlier.

    The authors' rule as their ``zclip`` package (``ZClip.step``, version
    1.0.0) computes it in its default variant, ``mode="zscore"`` with
    ``clip_option="adaptive_scaling"`` (``clip_factor=1``,
    ``skip_update_on_spike=False``); their optional hard cap
    ``max_grad_norm`` is not part of it (``--clip-grad-norm`` combines with
    it, the smaller maximum winning, as in ZClip). For each norm ``g``:

    - warm-up: the first ``warmup_steps`` (25) norms are collected and not
      clipped; after the last of them the mean ``mu`` is their mean and the
      variance ``var`` their population variance (divided by n);
    - then ``z = (g - mu) / (sqrt(var) + eps)``; when ``z > z_threshold``
      (2.5) the norm is clipped to ``mu + z_threshold * sqrt(var) / (z /
      z_threshold)``, i.e. ``mu + z_threshold^2 sigma / z``: the further out,
      the lower the target (never above ``mu + z_threshold sigma``);
    - the moving averages are updated with the clipped target when it clipped,
      else with ``g``, mean first and the variance with the new mean:
      ``mu <- alpha mu + (1 - alpha) x``,
      ``var <- alpha var + (1 - alpha) (x - mu)^2`` (``alpha`` 0.97).

    :meth:`update` returns the step's maximum norm (None: no clipping); the
    gradients are scaled by ``max / (g + 1e-6)``, as ZClip's.
    """

    def __init__(self, z_threshold: float = 2.5, alpha: float = 0.97, warmup_steps: int = 25, eps: float = 1e-6):
        if not z_threshold > 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.z_threshold = float(z_threshold)
        self.alpha = float(alpha)
        self.warmup_steps = int(warmup_steps)
        self.eps = float(eps)
        self.buffer: List[float] = []
        self.mean: Optional[float] = None
        self.var: Optional[float] = None

    def update(self, norm: float) -> Optional[float]:
        """Record this step's global ``norm``; the maximum norm of this step (None: no clipping)."""
        if self.mean is None:
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.buffer = []
            return None
        std = self.var**0.5
        z = (norm - self.mean) / (std + self.eps)
        target = None
        if z > self.z_threshold:
            target = self.mean + (self.z_threshold * std) / (z / self.z_threshold)
        x = norm if target is None else target
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return target

    def state_dict(self) -> Dict[str, Any]:
        return {"buffer": list(self.buffer), "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.buffer = list(state["buffer"])
        self.mean = state["mean"]
        self.var = state["var"]


class AutoClipThreshold:
    """AutoClip (Seetharaman, Wichern, Pardo, Le Roux, MLSP 2020, arXiv 2007.14469): clip the global norm
    at the ``percentile``-th percentile of every norm seen so far, this step's included.

    As the authors' reference code (``pseeth/autoclip``'s ``autoclip.py``):
    the step's norm is appended to the history, the threshold is
    ``numpy.percentile(history, p)`` (linear interpolation between the
    closest ranks) and the gradients are clipped to it by global norm. The
    history is never truncated. A norm at or below its threshold is left
    exactly as it is (the paper's factor ``min(threshold / norm, 1)``; the
    reference code's ``clip_grad_norm_`` would multiply it by ``norm / (norm
    + 1e-6)``). The paper tried p = 0 (the minimum so far),
    1, 10, 25, 50, 90 and 100 (never clips) and recommends p = 10 as
    "set-and-forget". Not the PyPI ``autoclip`` package's ``QuantileClip``,
    which leaves the step's own norm out of its history (so it clips its
    first step at infinity), keeps only the last 1000 norms and by default
    clips each parameter by its own history.
    """

    def __init__(self, percentile: float) -> None:
        if not 0.0 <= percentile <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {percentile}")
        self.percentile = float(percentile)
        self.history: List[float] = []  # sorted

    def update(self, norm: float) -> float:
        """Record this step's ``norm``; this step's maximum norm (the percentile of the history)."""
        bisect.insort(self.history, norm)
        return percentile_linear(self.history, self.percentile)

    def state_dict(self) -> Dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history = sorted(state["history"])


def percentile_linear(ascending: Sequence[float], percentile: float) -> float:
    """The ``percentile``-th percentile of the ascending values, as ``numpy.percentile``'s default ("linear",
    type 7 of Hyndman and Fan): the point at rank ``p / 100 * (n - 1)`` between the two closest values."""
    if not ascending:
        raise ValueError("percentile of no values")
    rank = (len(ascending) - 1) * (percentile / 100.0)
    below = math.floor(rank)
    above = min(below + 1, len(ascending) - 1)
    frac = rank - below
    low, high = ascending[below], ascending[above]
    # numpy's lerp: from the nearer end, so that frac 1 gives the upper value exactly.
    return low + (high - low) * frac if frac < 0.5 else high - (high - low) * (1 - frac)


class ScaledAdamClipping:
    """icefall ScaledAdam's gradient clipping (``clipping_scale``), exactly as its ``_get_clipping_scale``
    computes it (``k2-fsa/icefall``, ``egs/librispeech/ASR/zipformer/optim.py``), outside the optimizer.

    Per step s (counted as the optimizer's steps, from 0):

    - the norm is that of the gradients each multiplied by its parameter's
      RMS ``sqrt(mean(p^2))`` (per tensor; a one-element parameter's
      gradient by ``scalar_lr_scale``, 0.1, instead):
      ``sqrt(sum_p ||g_p r_p||^2)``. The RMS is the optimizer's own
      ``param_rms`` state: measured at step 0 and re-measured every
      ``size_update_period`` (4) steps, at the steps s with ``s % 4 == 3``
      after clipping (from the weights before that step's update), so a step
      clips with an RMS up to four updates old. No floor: a zero-initialised
      bias counts for nothing until it grows (icefall's ``param_min_rms``
      floor of 1e-5 applies to its update size, not to this norm);
    - step 0 is neither clipped nor recorded (ScaledAdam has no state yet);
    - from step 1 the norm goes into a ring of ``clipping_update_period``
      (100) slots, first all zero, at slot ``s % 100``;
    - the threshold is set at steps 10, 20 and 40 (those below the period),
      from the ``s`` largest slots (the norms so far), and then at every
      step with ``s % 100 == 0``, from all 100 slots: ``clipping_scale`` x
      their "median" ``sorted[(n // 4) * 2]`` (of 10 norms the 5th smallest),
      doubled at steps 10, 20 and 40 ("as norm may be changing rapidly").
      Before step 10 there is none and nothing is clipped; the step's own
      norm is recorded before the threshold is estimated;
    - the factor is ``min(1, threshold / (norm + 1e-20))`` (0 if that is NaN:
      the gradients are zeroed); a NaN median raises.

    icefall clips each parameter group by itself; a model trained with one
    group (the recipes) has one global rule, as here. :meth:`scale` returns the
    factor to multiply every gradient by.
    """

    def __init__(
        self,
        clipping_scale: float = 2.0,
        clipping_update_period: int = 100,
        scalar_lr_scale: float = 0.1,
        size_update_period: int = 4,
    ) -> None:
        if not clipping_scale > 0:
            raise ValueError(f"clipping_scale must be > 0, got {clipping_scale}")
        if clipping_update_period < 1 or size_update_period < 1:
            raise ValueError(f"the update periods must be >= 1, got {clipping_update_period} and {size_update_period}")
        self.clipping_scale = float(clipping_scale)
        self.clipping_update_period = int(clipping_update_period)
        self.scalar_lr_scale = float(scalar_lr_scale)
        self.size_update_period = int(size_update_period)
        self.step = 0
        self.model_norms: Optional[Tensor] = None  # the ring of norms, float32 on the gradients' device
        self.threshold: Optional[float] = None
        self.param_rms: Dict[str, float] = {}  # float32 values, by parameter name
        self.last_norm: Optional[float] = None  # the weighted norm of the last step (for logging)

    def _measure_rms(self, named: Sequence[Tuple[str, Tensor]]) -> None:
        """``param_rms`` of every parameter of more than one element, with one host sync."""
        tensors = [(name, p) for name, p in named if p.numel() > 1]
        if not tensors:
            return
        device = tensors[0][1].device
        rms = [p.detach().square().mean().sqrt().to(device=device, dtype=torch.float32) for _, p in tensors]
        self.param_rms.update(zip([name for name, _ in tensors], torch.stack(rms).tolist()))

    def scale(self, named: Sequence[Tuple[str, Tensor]]) -> float:
        """Record this step; the factor to multiply every gradient by (1: not clipped).

        Args:
          named: every trained parameter as ``(name, parameter)``, the same
            names every step (a parameter without ``.grad`` counts as a zero
            gradient, as in ScaledAdam).
        """
        step = self.step
        if step == 0:
            self._measure_rms(named)
            self.step = 1
            return 1.0
        missing = [(name, p) for name, p in named if p.numel() > 1 and name not in self.param_rms]
        if missing:  # a parameter this rule has not seen yet: measured now
            self._measure_rms(missing)
        with_grad = [(name, p) for name, p in named if p.grad is not None]
        if not with_grad:
            raise ValueError("ScaledAdamClipping.scale: no parameter has a gradient")
        grads = [p.grad for _, p in with_grad]
        device = grads[0].device
        weights = torch.tensor(
            [self.scalar_lr_scale if p.numel() == 1 else self.param_rms[name] for name, p in with_grad],
            dtype=torch.float32,
            device=device,
        )
        norms = torch.stack([n.to(device=device, dtype=torch.float32) for n in per_tensor_norms(grads)])
        tot_norm = torch.linalg.vector_norm(norms * weights)
        period = self.clipping_update_period
        if self.model_norms is None:
            self.model_norms = torch.zeros(period, dtype=torch.float32, device=device)
        elif self.model_norms.device != device:  # restored from a checkpoint (kept on the CPU)
            self.model_norms = self.model_norms.to(device)
        self.model_norms[step % period] = tot_norm
        irregular = [i for i in (10, 20, 40) if i < period]
        if step % period == 0 or step in irregular:
            sorted_norms = self.model_norms.sort()[0].cpu()
            if step in irregular:
                sorted_norms = sorted_norms[-step:]
            num_norms = sorted_norms.numel()
            median = sorted_norms[min(num_norms - 1, (num_norms // 4) * 2)].item()
            if median - median != 0:
                raise RuntimeError("ScaledAdamClipping: too many gradients were not finite (the median norm is NaN)")
            threshold = self.clipping_scale * median
            if step in irregular:
                threshold = threshold * 2.0
            self.threshold = threshold
        ans = 1.0
        if self.threshold is not None:
            ans = min(1.0, (self.threshold / (tot_norm + 1.0e-20)).item())
            if ans != ans:
                ans = 0.0
        if step % self.size_update_period == self.size_update_period - 1:
            self._measure_rms(named)
        self.last_norm = float(tot_norm)
        self.step = step + 1
        return ans

    def state_dict(self) -> Dict[str, Any]:
        return {
            "step": self.step,
            "model_norms": None if self.model_norms is None else self.model_norms.detach().cpu().clone(),
            "threshold": self.threshold,
            "param_rms": dict(self.param_rms),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        norms = state["model_norms"]
        self.model_norms = None if norms is None else norms.clone()
        self.threshold = state["threshold"]
        self.param_rms = dict(state["param_rms"])
