"""Per-step TensorBoard scalars kept off the device's critical path.

Reading a GPU tensor into a Python float waits for every kernel queued before
it. A training step has dozens of such statistics (the GradientFilter's per
layer, the optimizer's second moment per tensor), so :class:`StepLog` keeps
them as device tensors and reads them all with one transfer when it is
flushed, at the log interval, before a checkpoint and at the end of training.
Every scalar is still written at its own step.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

from icefall_lite.utils import MetricsTracker

Scalar = Union[float, int, torch.Tensor]


def read_scalars(values: List[Scalar]) -> List[float]:
    """``values`` as Python floats, with one device-to-host transfer per device for the tensors among them."""
    out: List[float] = [float(v) if not isinstance(v, torch.Tensor) else 0.0 for v in values]
    by_device: dict = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in indices])
        for i, x in zip(indices, stacked.tolist()):
            out[i] = x
    return out


def read_metrics(tracker: MetricsTracker) -> MetricsTracker:
    """A copy of ``tracker`` with its device tensors read as Python floats (one transfer per device)."""
    out = MetricsTracker()
    for key, value in zip(tracker, read_scalars(list(tracker.values()))):
        out[key] = value
    return out


class StepLog:
    """Scalars ``(tag, value, step, when)`` waiting to be written to ``writer`` (a SummaryWriter, or None:
    then nothing is kept); one whose ``when`` (a device flag) is false is not written."""

    def __init__(self, writer: Optional[Any]) -> None:
        self.writer = writer
        self.pending: List[Tuple[str, Scalar, int, Optional[Scalar]]] = []

    def add(self, tag: str, value: Scalar, step: int, when: Optional[Scalar] = None) -> None:
        """Queue a scalar; a tensor is copied (on its device, no read), since a replayed CUDA graph overwrites
        the tensors of its step (the filters' statistics among them) on every replay."""
        if self.writer is not None:
            value, when = (v.detach().clone() if isinstance(v, torch.Tensor) else v for v in (value, when))
            self.pending.append((tag, value, step, when))

    def flush(self) -> None:
        """Write every pending scalar whose flag is true, in the order they were added."""
        if not self.pending:
            return
        values = read_scalars([v for _, value, _, when in self.pending for v in (value, 1 if when is None else when)])
        for i, (tag, _, step, _) in enumerate(self.pending):
            if values[2 * i + 1]:
                self.writer.add_scalar(tag, values[2 * i], step)
        self.pending = []
