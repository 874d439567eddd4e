"""Runs paired by seed, on one CPU model.

A seed fixes the initialisation and the batch order in every arm, but not the rounding: the same command on
two CPU models (with and without AVX512-BF16, say) parts after a few steps, and by as much as an arm's effect.
A pair whose two runs were made on different CPU models is therefore left out of every comparison; a run
whose summary does not record its CPU model (those written before the field existed) cannot be checked, and
is counted as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from studies.ablation.records import RunResult

NOT_RECORDED = "CPU model not recorded"


def cpu_of(result: RunResult) -> Optional[str]:
    """The CPU a run counts as made on: its model, with its instruction-set digest and thread count where the
    summary records them (round 2 on), or the CPU that one was shown to compute as
    (:mod:`studies.ablation.cpus`); None when the summary does not say."""
    return result.computes_as or cpu_name(result.machine)


def cpu_name(machine: Dict[str, str]) -> Optional[str]:
    """A machine record's CPU (:func:`studies.runner.machine_record`) as :func:`cpu_of` names it."""
    if not machine.get("cpu_model"):
        return None
    extras = [f"flags {machine['cpu_flags']}"] if machine.get("cpu_flags") else []
    extras += [f"{machine['threads']} threads"] if machine.get("threads") else []
    return machine["cpu_model"] + (f" ({', '.join(extras)})" if extras else "")


@dataclass
class Pairing:
    """The seeds two arms share with a finite value each and runs from one CPU model: the values and
    ``arm - baseline`` per seed; the seeds left out because their runs straddle two CPU models; the seeds
    kept whose CPU models are not recorded (so not checked)."""

    arm_values: Dict[int, float] = field(default_factory=dict)
    baseline_values: Dict[int, float] = field(default_factory=dict)
    straddling: List[int] = field(default_factory=list)
    unchecked: List[int] = field(default_factory=list)
    linked: List[int] = field(default_factory=list)  # kept: two recorded CPUs shown to compute alike (cpus.json)

    @property
    def differences(self) -> Dict[int, float]:
        return {s: self.arm_values[s] - self.baseline_values[s] for s in sorted(self.arm_values)}


def pair_runs(arm: Sequence[RunResult], baseline: Sequence[RunResult], value: Callable[[RunResult], float]) -> Pairing:
    """Pair ``arm``'s and ``baseline``'s runs by seed (``value`` of each run, finite ones only), leaving out the
    pairs made on two CPU models."""
    base = {r.key.seed: r for r in baseline}
    out = Pairing()
    for r in sorted(arm, key=lambda r: r.key.seed):
        other = base.get(r.key.seed)
        if other is None:
            continue
        a, b = value(r), value(other)
        if not (math.isfinite(a) and math.isfinite(b)):
            continue
        cpus = (cpu_of(r), cpu_of(other))
        if None in cpus:
            out.unchecked.append(r.key.seed)
        elif cpus[0] != cpus[1]:
            out.straddling.append(r.key.seed)
            continue
        elif cpu_name(r.machine) != cpu_name(other.machine):
            out.linked.append(r.key.seed)
        out.arm_values[r.key.seed] = a
        out.baseline_values[r.key.seed] = b
    return out
