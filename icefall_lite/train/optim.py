"""Optimizers and LR schedule in the style of icefall's ``optim.py``: Eve (Adam with a
norm-targeting weight decay), ScaledAdam (zipformer's) and the Eden schedule."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from icefall_lite.nn.clip import RunningMedianThreshold


def _evaluate(closure) -> Optional[Tensor]:
    """The loss of ``closure`` with gradients enabled (``Optimizer.step``'s convention), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _as_written(method):
    """A method of :class:`torch.optim.Optimizer` without its ``torch._disable_dynamo`` wrapper (the function
    that ``functools.wraps`` records as ``__wrapped__``; the method itself where torch has no wrapper)."""
    return getattr(method, "__wrapped__", method)


class StagedLrOptimizer(Optimizer):
    """An optimizer whose step reads each group's learning rate from a float64 device tensor, staged from the
    group's Python float before the step (:meth:`stage_lr`), so that the step itself reads and freezes no
    Python value that changes from step to step (a CUDA graph of the step replays with the rate staged
    before it)."""

    # torch wraps these four so that torch.compile does not trace them, and the wrapper imports torch._dynamo
    # at its first call: about 2 s of CPU in each process, a third of a 6-step train.py run of the tests' tiny
    # model (2026-12-03, AMD EPYC beside a study run, /usr/bin/time of `train.py --max-batches 6` with the tests'
    # tiny flags, two pairs: 5.64 and 5.67 s of user CPU with the wrappers, 3.56 and 3.83 s without). Nothing
    # here is compiled (a step is replayed as a CUDA graph instead), so they are taken as written.
    add_param_group = _as_written(Optimizer.add_param_group)
    zero_grad = _as_written(Optimizer.zero_grad)
    state_dict = _as_written(Optimizer.state_dict)
    load_state_dict = _as_written(Optimizer.load_state_dict)

    def __init__(self, params: Iterable, defaults: Dict) -> None:
        super().__init__(params, defaults)
        # Each group's learning rate as step() reads it, a float64 device tensor, by (group, device), with the
        # Python float it holds.
        self._staged_lr: Dict[Tuple[int, torch.device], Tuple[float, Tensor]] = {}

    def __setstate__(self, state: Dict) -> None:  # unpickled or deep-copied: the rates staged again
        super().__setstate__(state)
        self._staged_lr = {}

    def stage_lr(self) -> None:
        """Copy each group's learning rate (a Python float) into the device tensor step() reads, where it
        changed. Eden calls it whenever it sets a rate, before the step, so that the copy is not part of the
        step; step() stages too, for a rate set by hand."""
        for i, group in enumerate(self.param_groups):
            for device in dict.fromkeys(p.device for p in group["params"]):
                self._lr_tensor(i, group, device)

    def _lr_tensor(self, i: int, group: Dict, device: torch.device) -> Tensor:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return lr
        staged = self._staged_lr.get((i, device))
        if staged is None or staged[0] != lr:
            tensor = torch.empty((), dtype=torch.float64, device=device) if staged is None else staged[1]
            self._staged_lr[(i, device)] = (lr, tensor.fill_(lr))
        return self._staged_lr[(i, device)][1]


def _power(base: float, exponent: Tensor) -> Tensor:
    """``base ** exponent`` in float64 on ``exponent``'s device, as Python computes it for floats (libm's pow
    on the CPU: a tensor exponent, which avoids torch's shortcuts for exponents such as 0.5)."""
    exponent = exponent.to(torch.float64)
    return torch.full_like(exponent, base).pow(exponent)


def _where(keep: Optional[Tensor], new: Tensor, old: Tensor) -> Tensor:
    """``new`` where ``keep`` (a 0-dim bool device tensor; None: everywhere), else ``old``."""
    return new if keep is None else torch.where(keep, new, old)


class Eve(StagedLrOptimizer):
    """Adam with betas (0.9, 0.98) plus icefall's weight decay and scalar clamping.

    - Weight decay is a multiplicative shrink ``p *= 1 - weight_decay`` (not
      scaled by lr), applied only to non-scalar tensors whose RMS is above
      ``target_rms``: it keeps weights from growing, not towards zero.
    - Scalar parameters (the log-scales of the Scaled* modules) are clamped
      into ``[-10, 2]`` after each step.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 1e-3,
        target_rms: float = 0.1,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 <= weight_decay <= 0.1:
            raise ValueError(f"Invalid weight_decay: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, target_rms=target_rms)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None, found_inf: Optional[Tensor] = None):
        """One update, without a host read: the step count and the bias corrections are device tensors.

        ``found_inf``: a 0-dim bool device tensor; where true the update is masked out (parameters, moments
        and step counts stay as they are: a skipped step), decided on the device.
        """
        loss = _evaluate(closure)
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Eve does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.float64, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif not isinstance(state["step"], Tensor):  # a checkpoint's count from before it was a tensor
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float64, device=p.device)
                self._update(group, p, state, self._lr_tensor(i, group, p.device), found_inf)
        return loss

    @staticmethod
    def _update(group: Dict, p: Tensor, state: Dict, lr: Tensor, found_inf: Optional[Tensor]) -> None:
        """Adam's update of ``p`` with icefall's decay and clamp, out of place then kept where not
        ``found_inf``; the arithmetic is that of Python floats: the bias corrections in float64 (libm's pow
        on the CPU, a tensor exponent avoiding torch's rsqrt shortcut), rounded to float32 where they meet
        the moments, and ``p + (value * exp_avg) / denom`` as torch's addcdiv computes it."""
        beta1, beta2 = group["betas"]
        grad, step = p.grad, state["step"] + 1
        exp_avg = torch.add(state["exp_avg"].mul(beta1), grad, alpha=1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
        correction2 = (1 - torch.full_like(step, beta2).pow(step)).pow(torch.full_like(step, -0.5))
        denom = (exp_avg_sq.sqrt() * correction2.to(p.dtype)).add_(group["eps"])
        step_size = lr.to(torch.float64) / (1 - torch.full_like(step, beta1).pow(step))
        new = p
        if p.numel() > 1:
            above = p.norm() > group["target_rms"] * p.numel() ** 0.5
            new = p.mul(1 - group["weight_decay"] * above.to(p.dtype))
        new = new + ((-step_size).to(p.dtype) * exp_avg) / denom
        if p.numel() == 1:
            new = new.clamp(min=-10.0, max=2.0)
        if found_inf is not None:
            keep = ~found_inf.to(p.device)
            new, exp_avg, exp_avg_sq = (
                torch.where(keep, a, b)
                for a, b in ((new, p), (exp_avg, state["exp_avg"]), (exp_avg_sq, state["exp_avg_sq"]))
            )
            step = torch.where(keep, step, state["step"])
        p.copy_(new)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        state["step"].copy_(step)


class Eden:
    """icefall's Eden schedule, stepped per batch and per epoch:

    ``lr = base_lr * ((b^2 + B^2) / B^2) ** -0.25 * ((e^2 + E^2) / E^2) ** -0.25``

    with ``b`` the global batch index, ``e`` the epoch index (0-based: epoch 1
    trains at ``e = 0``), ``B = lr_batches``, ``E = lr_epochs``.
    """

    def __init__(self, optimizer: Optimizer, lr_batches: float, lr_epochs: float) -> None:
        self.optimizer = optimizer
        self.lr_batches = float(lr_batches)
        self.lr_epochs = float(lr_epochs)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.batch = 0
        self.epoch = 0
        self._apply()

    def factor(self) -> float:
        batch_factor = ((self.batch**2 + self.lr_batches**2) / self.lr_batches**2) ** -0.25
        epoch_factor = ((self.epoch**2 + self.lr_epochs**2) / self.lr_epochs**2) ** -0.25
        return batch_factor * epoch_factor

    def _apply(self) -> None:
        factor = self.factor()
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base_lr * factor
        if isinstance(self.optimizer, StagedLrOptimizer):  # its rates on the device now, not in its step
            self.optimizer.stage_lr()

    def step_batch(self, batch: Optional[int] = None) -> None:
        self.batch = self.batch + 1 if batch is None else batch
        self._apply()

    def step_epoch(self, epoch: Optional[int] = None) -> None:
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self._apply()

    def get_last_lr(self) -> List[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> Dict[str, float]:
        return {"batch": self.batch, "epoch": self.epoch, "base_lrs": self.base_lrs}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.batch = state["batch"]
        self.epoch = state["epoch"]
        self.base_lrs = list(state["base_lrs"])
        self._apply()


class ScaledAdam(StagedLrOptimizer):
    """ScaledAdam, the optimizer of icefall's zipformer recipes (our own code, from its description).

    Per non-scalar tensor ``p`` with root-mean-square ``r`` (re-measured every
    ``size_update_period`` steps, clamped to ``[param_min_rms, param_max_rms]``):

    - the Adam-normalised gradient ``g / (sqrt(v / (1 - beta2^t)) + eps)`` is
      scaled by ``lr * r``, so every tensor moves by a fixed fraction of its
      own size whatever its scale;
    - the tensor's overall scale is learned as well: the gradient of the loss
      with respect to ``log(scale)`` is ``sum(p * g)``; summed over
      ``size_update_period`` steps and Adam-normalised, it moves the scale with
      learning rate ``lr * scalar_lr_scale`` (never above ``param_max_rms``:
      there the scale shrinks by that rate instead, and it does not shrink
      below ``param_min_rms``);
    - both go through momentum ``beta1`` on the update.

    Scalars get plain Adam with learning rate ``lr * scalar_lr_scale``,
    clamped to ``[-scalar_max, scalar_max]``.

    Clipping (``clipping_scale``, zipformer: 2.0): the gradient norm, with each
    non-scalar tensor's gradient weighted by its ``r``, is recorded every step;
    the threshold is ``clipping_scale`` times the median of the recent norms,
    re-estimated at steps 10, 20, 40 and every ``clipping_update_period``
    steps; no clipping before step 10. ``num_clipped`` counts clipped steps and
    ``last_clipping_scale`` is the factor of the last step (1 = not clipped).

    The step reads nothing back from the device (what a CUDA graph needs): the step counts, the learning rate
    (:class:`StagedLrOptimizer`), the clipping decision and its counters are device tensors, the scale's update
    of every ``size_update_period``-th step is computed each step and kept on those steps, and
    ``step(found_inf=...)`` masks out the whole update, the clipping history included, where a skipped step's
    flag is set. Its arithmetic is the host-decided step's except that an update scaled by the learning rate is
    a multiply then an add (``add_(alpha=)`` fuses them): over 20 steps of the tiny model the parameters agree
    to 3.6e-7 relative (``tests/test_step_sync_free.py``).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-2,
        clipping_scale: Optional[float] = 2.0,
        betas: Tuple[float, float] = (0.9, 0.98),
        scalar_lr_scale: float = 0.1,
        eps: float = 1e-8,
        param_min_rms: float = 1e-5,
        param_max_rms: float = 3.0,
        scalar_max: float = 10.0,
        size_update_period: int = 4,
        clipping_update_period: int = 100,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if clipping_scale is not None and clipping_scale <= 0:
            raise ValueError(f"clipping_scale must be positive or None, got {clipping_scale}")
        defaults = dict(
            lr=lr,
            betas=betas,
            scalar_lr_scale=scalar_lr_scale,
            eps=eps,
            param_min_rms=param_min_rms,
            param_max_rms=param_max_rms,
            scalar_max=scalar_max,
            size_update_period=size_update_period,
        )
        super().__init__(params, defaults)
        self.clipping_scale = clipping_scale
        self.clipping_update_period = clipping_update_period
        # Device tensors from the first step on (moved to the gradients' device there).
        self._num_clipped = torch.zeros((), dtype=torch.int64)
        self.last_clipping_scale = torch.ones((), dtype=torch.float64)
        self._clip_threshold = (
            None if clipping_scale is None else RunningMedianThreshold(clipping_scale, clipping_update_period)
        )

    @property
    def num_clipped(self) -> int:
        """The steps clipped so far (a host read)."""
        return int(self._num_clipped)

    def state_dict(self) -> Dict:
        state = super().state_dict()
        if self._clip_threshold is not None:
            state["clipping"] = {**self._clip_threshold.state_dict(), "num_clipped": self.num_clipped}
        return state

    def load_state_dict(self, state_dict: Dict) -> None:
        state_dict = dict(state_dict)
        clipping = state_dict.pop("clipping", None)
        super().load_state_dict(state_dict)
        if clipping is not None and self._clip_threshold is not None:
            self._clip_threshold.load_state_dict(clipping)
            self._num_clipped = torch.tensor(int(clipping["num_clipped"]), device=self._num_clipped.device)

    @staticmethod
    def _param_rms(p: Tensor, state: Dict) -> Tensor:
        if "param_rms" not in state:
            state["param_rms"] = p.detach().square().mean().sqrt()
        return state["param_rms"]

    def _clipping_factor(self, found_inf: Optional[Tensor]) -> Tensor:
        """Record this step's weighted gradient norm (unless ``found_inf``); the factor to scale the gradients
        by, a 0-dim float64 device tensor."""
        terms = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                sumsq = p.grad.detach().double().square().sum()
                terms.append(sumsq if p.numel() == 1 else sumsq * self._param_rms(p, self.state[p]).double() ** 2)
        total = torch.stack(terms).sum().sqrt() if terms else torch.zeros((), dtype=torch.float64)
        threshold = self._clip_threshold.update(total, skip=found_inf)  # inf: no threshold yet
        clipped = torch.isfinite(threshold) & (total > threshold) & (total != 0.0)
        factor = torch.where(clipped, threshold / total, torch.ones_like(total))
        keep = None if found_inf is None else ~found_inf
        self._num_clipped = self._num_clipped.to(total.device)
        self.last_clipping_scale = self.last_clipping_scale.to(total.device)
        self._num_clipped.add_((clipped if keep is None else clipped & keep).to(torch.int64))
        self.last_clipping_scale.copy_(_where(keep, factor, self.last_clipping_scale))
        return factor

    @torch.no_grad()
    def step(self, closure=None, found_inf: Optional[Tensor] = None):
        """One update, without a host read. ``found_inf``: a 0-dim bool device tensor; where true nothing
        changes (parameters, state, the clipping history and counters: a skipped step), decided on the device."""
        loss = _evaluate(closure)
        factor = None if self._clip_threshold is None else self._clipping_factor(found_inf)
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ScaledAdam does not support sparse gradients")
                # The factor rounded to the gradient's dtype first, as a Python float would be (a 0-dim float64
                # tensor would make a scalar parameter's update float64).
                grad = p.grad if factor is None else p.grad * factor.to(p.grad.device, p.grad.dtype)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.int64, device=p.device)
                    state["delta"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                elif not isinstance(state["step"], Tensor):  # a checkpoint's count from before it was a tensor
                    state["step"] = torch.tensor(int(state["step"]), dtype=torch.int64, device=p.device)
                lr = self._lr_tensor(i, group, p.device)
                if p.numel() == 1:
                    new = self._step_scalar(group, p, grad, state, lr)
                else:
                    new = self._step_tensor(group, p, grad, state, lr)
                keep = None if found_inf is None else ~found_inf.to(p.device)
                for name, value in new.items():
                    target = p if name == "param" else state[name]
                    target.copy_(_where(keep, value, target))
        return loss

    @staticmethod
    def _step_scalar(group: Dict, p: Tensor, grad: Tensor, state: Dict, lr: Tensor) -> Dict[str, Tensor]:
        """Plain Adam on a scalar: the new parameter and state, out of place."""
        beta1, beta2 = group["betas"]
        step = state["step"] + 1
        exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
        bias_correction2 = 1 - _power(beta2, step)
        denom = (exp_avg_sq / bias_correction2.to(p.dtype)).sqrt() + group["eps"]
        scale = (-lr * group["scalar_lr_scale"] * (1 - beta1)).to(p.dtype)
        delta = state["delta"].mul(beta1) + grad / denom * scale
        param = (p + delta).clamp(min=-group["scalar_max"], max=group["scalar_max"])
        return {"param": param, "delta": delta, "exp_avg_sq": exp_avg_sq, "step": step}

    def _step_tensor(self, group: Dict, p: Tensor, grad: Tensor, state: Dict, lr: Tensor) -> Dict[str, Tensor]:
        """The scaled update of a non-scalar tensor: the new parameter and state, out of place."""
        beta1, beta2 = group["betas"]
        period = group["size_update_period"]
        step = state["step"]
        param_rms = self._param_rms(p, state)
        if "scale_grads" not in state:
            state["scale_grads"] = torch.zeros(period, dtype=p.dtype, device=p.device)
            state["scale_exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device)
        slot = torch.arange(period, device=p.device) == torch.remainder(step, period)
        scale_grads = torch.where(slot, (p.detach() * grad).sum(), state["scale_grads"])
        delta = state["delta"].mul(beta1)
        # The scale: an Adam step on d(loss)/d(log scale), kept on the last step of each period.
        size_step = torch.remainder(step, period) == period - 1
        scale_exp_avg_sq = state["scale_exp_avg_sq"].mul(beta2**period)
        scale_exp_avg_sq = scale_exp_avg_sq.add(scale_grads.square().mean(), alpha=1 - beta2**period)
        size_lr = lr * group["scalar_lr_scale"]
        size_correction2 = 1 - _power(beta2, torch.div(step + 1, period, rounding_mode="floor"))
        denom = scale_exp_avg_sq.sqrt() + group["eps"]
        root = size_correction2.pow(torch.full_like(size_correction2, 0.5))  # Python's ** 0.5 (not sqrt)
        scale_step = (-size_lr * root).to(p.dtype) * scale_grads.sum() / denom
        scale_step = torch.where(param_rms < group["param_min_rms"], scale_step.clamp(min=0.0), scale_step)
        scale_step = torch.where(param_rms > group["param_max_rms"], (-size_lr * period).to(p.dtype), scale_step)
        delta = torch.where(size_step, delta.add(p.detach() * scale_step, alpha=1 - beta1), delta)
        new_rms = torch.where(size_step, p.detach().square().mean().sqrt(), param_rms)
        scale_exp_avg_sq = torch.where(size_step, scale_exp_avg_sq, state["scale_exp_avg_sq"])
        # The Adam-normalised gradient, scaled by the tensor's RMS (as it was before this step's size update).
        exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
        bias_correction2 = 1 - _power(beta2, step + 1)
        denom = (exp_avg_sq / bias_correction2.to(p.dtype)).sqrt() + group["eps"]
        rms = param_rms.clamp(min=group["param_min_rms"], max=group["param_max_rms"])
        delta = delta + grad / denom * rms * (-lr * (1 - beta1)).to(p.dtype)
        return {
            "param": p + delta,
            "delta": delta,
            "exp_avg_sq": exp_avg_sq,
            "step": step + 1,
            "param_rms": new_rms,
            "scale_grads": scale_grads,
            "scale_exp_avg_sq": scale_exp_avg_sq,
        }
