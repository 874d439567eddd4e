"""Optimizer and LR schedule in the style of icefall's ``optim.py``: Eve (Adam with a
norm-targeting weight decay) and the Eden schedule."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer


class Eve(Optimizer):
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
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Eve does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = state["step"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() * (1 - beta2**step) ** -0.5).add_(group["eps"])
                step_size = group["lr"] / (1 - beta1**step)
                if p.numel() > 1:
                    above = p.norm() > group["target_rms"] * p.numel() ** 0.5
                    p.mul_(1 - group["weight_decay"] * above.to(p.dtype))
                p.addcdiv_(exp_avg, denom, value=-step_size)
                if p.numel() == 1:
                    p.clamp_(min=-10.0, max=2.0)
        return loss


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
