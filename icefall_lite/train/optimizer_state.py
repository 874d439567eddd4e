"""What a gradient outlier does to Adam's second moment, step by step.

Under Adam (and Eve, ScaledAdam), a gradient k times its usual size rarely
spikes the loss: it inflates that tensor's ``exp_avg_sq`` by about
``beta2 + (1 - beta2) k^2`` and so shrinks the tensor's updates for as many
steps as the second moment takes to decay back (``ln(J) / (1 - beta2)``
steps for an inflation ``J``). :class:`SecondMomentMonitor` measures both
after every optimizer step:

- the **jump**: the largest ratio, over parameter tensors, of the sum of
  ``exp_avg_sq`` after the step to the sum before it (1.0 for a skipped step
  or a tensor without state yet);
- the **recovery**: for each tensor whose sum jumped by more than
  ``event_jump``, the number of steps until its sum is back at or below
  ``recovered_ratio`` times its value before the jump.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

# A jump of more than EVENT_JUMP x opens an inflation event (a gradient about 10x its usual RMS under beta2 0.98
# gives 0.98 + 0.02 x 100 = 2.98); the event ends once the tensor's sum is at most RECOVERED_RATIO x its value
# before the jump.
EVENT_JUMP = 2.0
RECOVERED_RATIO = 1.25


@dataclass
class InflationEvent:
    """An open inflation event of one tensor: the step of the jump, its size and the sum before it."""

    name: str
    step: int
    jump: float
    before: float


@dataclass
class StepReport:
    """One step's measurements: the largest jump (and its tensor) and the events that recovered at this step
    (``recovery_steps``: steps from the jump to the recovery, one per event)."""

    jump: float
    jump_tensor: str
    recovery_steps: List[int]


class SecondMomentMonitor:
    """Watches the ``exp_avg_sq`` of every parameter of ``model`` in ``optimizer``'s state (see the module doc).

    Built once the optimizer's state is loaded (a resumed run measures its first step as the uninterrupted
    run did; an event open at the checkpoint is not carried over). After every training step (skipped steps
    included) call :meth:`record`, which only queues the sums on the device, and read the reports of the
    queued steps with :meth:`reports` (one device-to-host transfer), or do both with :meth:`update`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        event_jump: float = EVENT_JUMP,
        recovered_ratio: float = RECOVERED_RATIO,
    ) -> None:
        self.named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.event_jump = event_jump
        self.recovered_ratio = recovered_ratio
        self.pending: List[Tuple[int, List[str], Optional[torch.Tensor]]] = []
        self.previous: Dict[str, float] = {}
        self.open_events: Dict[str, InflationEvent] = {}
        self.record(0)
        self.reports()

    def _sums(self) -> Tuple[List[str], Optional[torch.Tensor]]:
        """The names of the tensors that have an ``exp_avg_sq`` and the float64 sums of theirs, on the device."""
        names, sums = [], []
        for name, p in self.named:
            state = self.optimizer.state.get(p)
            if state is not None and "exp_avg_sq" in state:
                names.append(name)
                sums.append(state["exp_avg_sq"].detach().double().sum())
        return names, (torch.stack(sums) if sums else None)

    def record(self, step: int) -> None:
        """Queue the sums after the step just taken (``step``: its global batch index); nothing is read yet."""
        names, sums = self._sums()
        self.pending.append((step, names, sums))

    def reports(self) -> List[Tuple[int, StepReport]]:
        """``(step, report)`` of every queued step, in order; the sums of all of them read in one transfer."""
        pending, self.pending = self.pending, []
        queued = [sums for _, _, sums in pending if sums is not None]
        values = iter(torch.cat(queued).tolist() if queued else [])
        return [(step, self._measure(step, {name: next(values) for name in names})) for step, names, _ in pending]

    def update(self, step: int) -> StepReport:
        """Measure the step just taken at once (``step``: its global batch index)."""
        self.record(step)
        return self.reports()[-1][1]

    def _measure(self, step: int, now: Dict[str, float]) -> StepReport:
        jump, jump_tensor = 1.0, ""
        recovered: List[int] = []
        for name, value in now.items():
            before = self.previous.get(name)
            event = self.open_events.get(name)
            if event is not None and value <= self.recovered_ratio * event.before:
                recovered.append(step - event.step)
                del self.open_events[name]
            if before is None or before <= 0.0:
                continue
            ratio = value / before
            if ratio > jump:
                jump, jump_tensor = ratio, name
            if ratio > self.event_jump and name not in self.open_events:
                self.open_events[name] = InflationEvent(name, step, ratio, before)
        self.previous = now
        return StepReport(jump, jump_tensor, recovered)

    def largest_open(self) -> Optional[InflationEvent]:
        """The open event with the largest jump (None when every tensor has recovered; read :meth:`reports`
        first)."""
        return max(self.open_events.values(), key=lambda e: e.jump, default=None)
