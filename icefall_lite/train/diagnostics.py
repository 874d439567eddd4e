"""Per-module value and gradient statistics (``--print-diagnostics``) and
non-finite checks (``--inf-check``), in the spirit of icefall's
``diagnostics.py`` and ``hooks.py``.

The diagnostics locate an exploding layer: for every module output they
accumulate the RMS of the value and of its gradient, and for every sequence
the gradient RMS, so that the ratio of the largest to the median sequence
gradient shows where a few sequences explode.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from torch import Tensor


@dataclass
class TensorStats:
    """Running statistics of one tensor kind (module output value or gradient)."""

    count: int = 0
    rms_sum: float = 0.0
    abs_max: float = 0.0
    positive_fraction_sum: float = 0.0
    seq_max_over_median: List[float] = field(default_factory=list)

    def update(self, x: Tensor, batch_dim: int) -> None:
        x = x.detach().float()
        self.count += 1
        self.rms_sum += float(x.square().mean().sqrt())
        self.abs_max = max(self.abs_max, float(x.abs().max()))
        self.positive_fraction_sum += float((x > 0).float().mean())
        if x.ndim >= 2 and x.size(batch_dim) > 1:
            dims = [d for d in range(x.ndim) if d != batch_dim]
            per_seq = x.square().mean(dim=dims).sqrt()
            median = float(per_seq.median())
            if median > 0:
                self.seq_max_over_median.append(float(per_seq.max()) / median)

    def summary(self) -> str:
        if self.count == 0:
            return "no data"
        ratio = max(self.seq_max_over_median) if self.seq_max_over_median else float("nan")
        return (
            f"rms={self.rms_sum / self.count:.3g} abs_max={self.abs_max:.3g} "
            f"frac_pos={self.positive_fraction_sum / self.count:.3f} max/median(seq)={ratio:.3g}"
        )


def _batch_dim_of(name: str, module: nn.Module) -> int:
    """(T, N, C) inside the encoder layers, (N, ...) elsewhere."""
    return 1 if ".layers." in f".{name}." and not isinstance(module, nn.Dropout) else 0


class ModelDiagnostics:
    """Attach hooks that accumulate statistics of every module's output and output gradient,
    and of every parameter's value and gradient. ``print_diagnostics()`` logs them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.values: Dict[str, TensorStats] = defaultdict(TensorStats)
        self.grads: Dict[str, TensorStats] = defaultdict(TensorStats)
        self.handles = []
        for name, module in model.named_modules():
            if name == "":
                continue
            self.handles.append(module.register_forward_hook(self._forward_hook(name, module)))

    def _forward_hook(self, name: str, module: nn.Module):
        batch_dim = _batch_dim_of(name, module)

        def hook(_module, _inputs, output):
            tensor = output[0] if isinstance(output, tuple) else output
            if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
                return
            self.values[name].update(tensor, batch_dim)
            if tensor.requires_grad:
                tensor.register_hook(lambda g: self.grads[name].update(g, batch_dim))

        return hook

    def print_diagnostics(self) -> str:
        """Log and return the per-module and per-parameter report."""
        lines = ["module output statistics (value | gradient):"]
        for name in self.values:
            lines.append(f"  {name}: value {self.values[name].summary()} | grad {self.grads[name].summary()}")
        lines.append("parameter statistics:")
        for name, p in self.model.named_parameters():
            g = "none" if p.grad is None else f"{float(p.grad.detach().float().square().mean().sqrt()):.3g}"
            lines.append(
                f"  {name}: shape={tuple(p.shape)} "
                f"value_rms={float(p.detach().float().square().mean().sqrt()):.3g} grad_rms={g}"
            )
        report = "\n".join(lines)
        logging.info(report)
        return report

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def register_inf_check_hooks(model: nn.Module) -> List[torch.utils.hooks.RemovableHandle]:
    """Log a warning naming the module whenever an output or its gradient is NaN/inf."""
    handles = []

    def make_hook(name: str):
        def hook(_module, _inputs, output):
            outputs = output if isinstance(output, tuple) else (output,)
            for i, o in enumerate(outputs):
                if not isinstance(o, Tensor) or not o.is_floating_point():
                    continue
                if not torch.isfinite(o).all():
                    logging.warning(f"inf-check: non-finite forward output {i} of module {name}")
                if o.requires_grad:
                    o.register_hook(
                        lambda g, i=i: (
                            logging.warning(f"inf-check: non-finite gradient of output {i} of module {name}")
                            if not torch.isfinite(g).all()
                            else None
                        )
                    )

        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(make_hook(name or "<model>")))
    return handles


def nonfinite_parameters(model: nn.Module) -> Tuple[List[str], List[str]]:
    """Names of parameters whose value, resp. gradient, has a NaN/inf."""
    bad_values = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    bad_grads = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return bad_values, bad_grads
