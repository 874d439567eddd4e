"""Thresholds that follow the history of the global gradient norm, each with a ``state_dict`` so that a
resumed run clips as the uninterrupted one:

- :class:`RunningMedianThreshold`: a multiple of the running median of the raw norm;
- :class:`ZClipThreshold`: ZClip's z-score rule;
- :class:`AutoClipThreshold`: AutoClip's percentile of every past norm;
- :class:`ScaledAdamClipping`: icefall ScaledAdam's rule, exactly.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

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

    Its state lives on the norm's device (a CUDA graph can replay :meth:`update`): a ring of
    ``update_period`` float64 slots (the norm of step s at slot ``s % update_period``), the step count and
    the threshold (inf: none yet), all updated in place, the estimate taken every step and kept only at the
    estimation steps.
    """

    def __init__(self, scale: float, update_period: int) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if update_period < 1:
            raise ValueError(f"update_period must be >= 1, got {update_period}")
        self.scale = scale
        self.update_period = update_period
        self._state: Dict[str, Any] = {"norms": [], "threshold": None, "steps": 0}  # until the first update
        self.ring: Optional[Tensor] = None  # (update_period,) float64
        self.steps: Optional[Tensor] = None  # () int64
        self.held: Optional[Tensor] = None  # () int64: the norms in the ring (at most update_period)
        self.threshold: Optional[Tensor] = None  # () float64, inf before the first estimate

    def _place(self, device: torch.device) -> None:
        """The state as device tensors on ``device`` (from :attr:`_state` the first time)."""
        if self.ring is not None:
            if self.ring.device != device:
                self.ring, self.steps, self.held, self.threshold = (
                    x.to(device) for x in (self.ring, self.steps, self.held, self.threshold)
                )
            return
        state, period = self._state, self.update_period
        steps = int(state["steps"])
        self.ring = torch.zeros(period, dtype=torch.float64, device=device)
        norms = list(state["norms"])[-period:]
        for j, norm in enumerate(norms):  # the last norm is that of step steps - 1
            self.ring[(steps - len(norms) + j) % period] = norm
        self.steps = torch.tensor(steps, dtype=torch.int64, device=device)
        self.held = torch.tensor(len(norms), dtype=torch.int64, device=device)
        threshold = math.inf if state["threshold"] is None else state["threshold"]
        self.threshold = torch.tensor(threshold, dtype=torch.float64, device=device)

    def update(self, norm: Union[float, Tensor], skip: Optional[Tensor] = None) -> Tensor:
        """Record this step's ``norm`` unless ``skip`` (a 0-dim bool tensor: a skipped step, neither recorded
        nor counted); the threshold for this step as a 0-dim float64 tensor (inf: no clipping yet)."""
        norm = torch.as_tensor(norm).to(torch.float64)
        self._place(norm.device)
        keep = torch.ones((), dtype=torch.bool, device=norm.device) if skip is None else ~skip
        period, step = self.update_period, self.steps
        ring = self.ring.index_put((torch.remainder(step, period).reshape(1),), norm.reshape(1))
        # The window: the last min(step, held) norms, this one's included (the others read inf).
        held = torch.clamp(self.held + 1, max=period)
        count = torch.minimum(step, held)
        age = torch.remainder(step - torch.arange(period, device=norm.device), period)
        ascending = torch.where(age < count, ring, math.inf).sort().values
        estimate = self.scale * ascending.gather(0, (count // 2).reshape(1)).reshape(())
        due = (step == 10) | (step == 20) | (step == 40) | ((step > 0) & (torch.remainder(step, period) == 0))
        self.threshold.copy_(torch.where(due & keep, estimate, self.threshold))
        self.ring.copy_(torch.where(keep, ring, self.ring))
        self.steps.add_(keep.to(torch.int64))
        self.held.copy_(torch.where(keep, held, self.held))
        return self.threshold.clone()  # the state changes in place at the next update

    def state_dict(self) -> Dict[str, Any]:
        """``norms`` (the last ``update_period``, oldest first), ``threshold`` (None: none yet) and ``steps``,
        as Python numbers (a host read: at a checkpoint, not in a step)."""
        if self.ring is None:
            return {**self._state, "norms": list(self._state["norms"])}
        steps = int(self.steps)
        period = self.update_period
        ring = self.ring.tolist()
        norms = [ring[s % period] for s in range(steps - int(self.held), steps)]
        threshold = float(self.threshold)
        return {"norms": norms, "threshold": None if math.isinf(threshold) else threshold, "steps": steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._state = {"norms": list(state["norms"]), "threshold": state["threshold"], "steps": int(state["steps"])}
        device = torch.device("cpu") if self.ring is None else self.ring.device  # moved at the next update
        self.ring = None
        self._place(device)


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

    :meth:`update` returns the step's maximum norm (inf: no clipping); the
    gradients are scaled by ``max / (g + 1e-6)``, as ZClip's.

    Its state lives on the norm's device in float64, updated in place (a CUDA graph can replay
    :meth:`update`): the warm-up's buffer, its count, whether the warm-up is over, the mean and the variance.
    Both branches are computed every step and the right one kept; the warm-up's sums are sequential
    (``cumsum``), as Python's ``sum``.
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
        self._state: Dict[str, Any] = {"buffer": [], "mean": None, "var": None}  # until the first update
        self.tensors: Optional[Dict[str, Tensor]] = None  # buffer (warmup_steps,), count, warmed, mean, var

    def _place(self, device: torch.device) -> Dict[str, Tensor]:
        if self.tensors is not None:
            if self.tensors["mean"].device != device:
                self.tensors = {k: v.to(device) for k, v in self.tensors.items()}
            return self.tensors
        state = self._state
        f64 = dict(dtype=torch.float64, device=device)
        buffer = torch.zeros(self.warmup_steps, **f64)
        buffer[: len(state["buffer"])] = torch.tensor(state["buffer"], **f64)
        warmed = state["mean"] is not None
        self.tensors = {
            "buffer": buffer,
            "count": torch.tensor(len(state["buffer"]), dtype=torch.int64, device=device),
            "warmed": torch.tensor(warmed, device=device),
            "mean": torch.tensor(state["mean"] if warmed else 0.0, **f64),
            "var": torch.tensor(state["var"] if warmed else 0.0, **f64),
            "half": torch.tensor(0.5, **f64),  # the exponent of Python's var ** 0.5 (a tensor: no sqrt shortcut)
        }
        return self.tensors

    def update(self, norm: Union[float, Tensor], skip: Optional[Tensor] = None) -> Tensor:
        """Record this step's global ``norm`` unless ``skip`` (a 0-dim bool tensor: a skipped step); the
        maximum norm of this step as a 0-dim float64 tensor (inf: no clipping)."""
        norm = torch.as_tensor(norm).to(torch.float64)
        s = self._place(norm.device)
        keep = torch.ones((), dtype=torch.bool, device=norm.device) if skip is None else ~skip
        warmed, mean, var = s["warmed"], s["mean"], s["var"]
        # The warm-up: collect; after the last norm, the mean and the population variance of the buffer.
        slot = torch.clamp(s["count"], max=self.warmup_steps - 1).reshape(1)
        buffer = s["buffer"].index_put((slot,), norm.reshape(1))
        count = s["count"] + 1
        complete = ~warmed & (count >= self.warmup_steps)
        first_mean = buffer.cumsum(0)[-1] / self.warmup_steps
        first_var = (buffer - first_mean).pow(2).cumsum(0)[-1] / self.warmup_steps
        # After it: the z-score, the target, the moving averages.
        std = var.pow(s["half"])  # libm's pow, as Python's var ** 0.5
        z = (norm - mean) / (std + self.eps)
        clips = warmed & (z > self.z_threshold)
        target = mean + (self.z_threshold * std) / (z / self.z_threshold)
        x = torch.where(clips, target, norm)
        new_mean = self.alpha * mean + (1 - self.alpha) * x
        new_var = self.alpha * var + (1 - self.alpha) * (x - new_mean).pow(2)
        collecting = keep & ~warmed
        s["buffer"].copy_(torch.where(collecting, buffer, s["buffer"]))
        s["count"].copy_(torch.where(collecting, torch.where(complete, 0, count), s["count"]))
        s["mean"].copy_(torch.where(keep, torch.where(warmed, new_mean, torch.where(complete, first_mean, mean)), mean))
        s["var"].copy_(torch.where(keep, torch.where(warmed, new_var, torch.where(complete, first_var, var)), var))
        s["warmed"].copy_(warmed | (keep & complete))
        return torch.where(clips, target, math.inf)

    @property
    def mean(self) -> Optional[float]:
        """The moving mean (None during the warm-up); a host read, for inspection."""
        return self.state_dict()["mean"]

    @property
    def var(self) -> Optional[float]:
        """The moving variance (None during the warm-up); a host read, for inspection."""
        return self.state_dict()["var"]

    def state_dict(self) -> Dict[str, Any]:
        """``buffer`` (the warm-up's norms so far), ``mean`` and ``var`` (None during the warm-up), as Python
        numbers (a host read: at a checkpoint, not in a step)."""
        if self.tensors is None:
            return {"buffer": list(self._state["buffer"]), "mean": self._state["mean"], "var": self._state["var"]}
        s = self.tensors
        warmed = bool(s["warmed"])
        return {
            "buffer": s["buffer"][: int(s["count"])].tolist(),
            "mean": float(s["mean"]) if warmed else None,
            "var": float(s["var"]) if warmed else None,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._state = {"buffer": list(state["buffer"]), "mean": state["mean"], "var": state["var"]}
        device = torch.device("cpu") if self.tensors is None else self.tensors["mean"].device
        self.tensors = None
        self._place(device)


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

    The history lives on the norm's device: float64 slots (inf where unused) and the count, sorted each step.
    Since it is never truncated its slots double when the calls so far (a host count, an upper bound of the
    norms recorded) fill them: a new shape, so a CUDA graph of the step is captured again at those steps
    (log2 of the steps, from :data:`AUTOCLIP_SLOTS`).
    """

    def __init__(self, percentile: float) -> None:
        if not 0.0 <= percentile <= 100.0:
            raise ValueError(f"percentile must be in [0, 100], got {percentile}")
        self.percentile = float(percentile)
        self._history: List[float] = []  # sorted; until the first update
        self.slots: Optional[Tensor] = None  # (capacity,) float64: the norms, then inf
        self.count: Optional[Tensor] = None  # () int64
        self.calls = 0

    def _place(self, device: torch.device) -> None:
        if self.slots is not None:
            if self.slots.device != device:
                self.slots, self.count = self.slots.to(device), self.count.to(device)
        else:
            capacity = AUTOCLIP_SLOTS
            while capacity <= len(self._history):
                capacity *= 2
            self.slots = torch.full((capacity,), math.inf, dtype=torch.float64, device=device)
            self.slots[: len(self._history)] = torch.tensor(self._history, dtype=torch.float64, device=device)
            self.count = torch.tensor(len(self._history), dtype=torch.int64, device=device)
            self.calls = len(self._history)
        if self.calls >= self.slots.numel():
            self.slots = torch.cat([self.slots, torch.full_like(self.slots, math.inf)])

    def update(self, norm: Union[float, Tensor], skip: Optional[Tensor] = None) -> Tensor:
        """Record this step's ``norm`` unless ``skip`` (a 0-dim bool tensor: a skipped step); this step's
        maximum norm (the percentile of the history) as a 0-dim float64 tensor."""
        norm = torch.as_tensor(norm).to(torch.float64)
        self._place(norm.device)
        keep = torch.ones((), dtype=torch.bool, device=norm.device) if skip is None else ~skip
        self.calls += 1
        # A skipped step writes inf (an unused slot's value) at the next slot and does not count.
        self.slots.index_put_((self.count.reshape(1),), torch.where(keep, norm, math.inf).reshape(1))
        self.count.add_(keep.to(torch.int64))
        ascending = self.slots.sort().values
        return percentile_linear(ascending, self.percentile, self.count)

    @property
    def history(self) -> List[float]:
        """Every norm recorded, ascending (a host read, for a checkpoint and for inspection)."""
        if self.slots is None:
            return list(self._history)
        return self.slots[: int(self.count)].sort().values.tolist()

    def state_dict(self) -> Dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._history = sorted(state["history"])
        device = torch.device("cpu") if self.slots is None else self.slots.device
        self.slots = self.count = None
        self._place(device)


# AutoClip's first slots (doubled as they fill).
AUTOCLIP_SLOTS = 1024


def percentile_linear(ascending: Union[Sequence[float], Tensor], percentile: float, count: Optional[Tensor] = None):
    """The ``percentile``-th percentile of the ascending values, as ``numpy.percentile``'s default ("linear",
    type 7 of Hyndman and Fan): the point at rank ``p / 100 * (n - 1)`` between the two closest values.

    ``ascending``: Python floats (a float back), or a float64 tensor whose first ``count`` (a 0-dim int64
    tensor) values are the ones (a 0-dim tensor back, computed on the device with the same float64 steps).
    """
    if count is not None:
        n = torch.clamp(count, min=1)  # no value (a skipped first step): any number, not clipping anything
        rank = (n - 1).to(torch.float64) * (percentile / 100.0)
        below = rank.floor()
        above = torch.minimum(below + 1, (n - 1).to(torch.float64))
        frac = rank - below
        low = ascending.gather(0, below.to(torch.int64).reshape(1)).reshape(())
        high = ascending.gather(0, above.to(torch.int64).reshape(1)).reshape(())
        return torch.where(frac < 0.5, low + (high - low) * frac, high - (high - low) * (1 - frac))
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
