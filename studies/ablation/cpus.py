"""Which CPUs compute a round's runs alike.

A seed pairs two runs only where they round alike: the same command on a CPU with another instruction set
parts from the first after a few steps, by as much as an arm's effect. Two CPUs are told apart by their
model, flags digest and thread count (:func:`studies.ablation.pairing.cpu_name`), which is stricter than
the rounding: a new CPU generation may add instructions the kernels never use. So the study can check a CPU
instead of assuming: it retrains, from scratch and with the same torch, the newest seed of each arm another
CPU made on a condition, for some steps, and compares every step's batch digest, losses and gradient norm
with the run's summary (to its 7 digits, not bit for bit). A training parts within a few steps of its first
rounding difference (a probe with one thread instead of two is in the recipe's README), so a CPU that
matches every step of every arm checked computes those steps as the other CPU does. What is not checked is
assumed: the other seeds, the steps after those retrained, decoding, and arms the other CPU makes later.
The outcome is recorded in ``<summaries>/cpus.json`` with the runs, the steps, the torch version and the
commands; the CPUs a matching record joins (for its condition and torch) count as one from then on, named by
the first of them in sorted order (:func:`computes_as`, :attr:`RunResult.computes_as`), so their runs pair.
A record that parted is kept too, with the step each run parted at, and joins nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from studies.ablation.arm_names import canonical_arm
from studies.ablation.records import RunResult
from studies.runner import read_json, write_json_atomic
from studies.tb_reader import Series, seven_digits

CPUS_FILE = "cpus.json"

# The summary's scalars a retraining must match at every step: the batches (exactly), the losses, and the
# gradient's norm before any control acts.
CHECKED = ("batch_digest", "simple_loss", "pruned_loss", "grad_norm")


@dataclass
class Reproduction:
    """``cpu`` retrained ``runs`` made on ``of`` for ``steps`` steps each: per run (its relpath) the first step
    whose values differ from its summary's, None when every step matched."""

    cpu: str
    of: str
    steps: int
    runs: Dict[str, Optional[int]]
    date: str
    commands: List[str]
    torch: str

    @property
    def reproduced(self) -> bool:
        return bool(self.runs) and all(step is None for step in self.runs.values())

    @property
    def conditions(self) -> List[str]:
        """The conditions of the runs retrained (a run's relpath is ``<condition>/<arm>/seed-<s>``)."""
        return sorted({relpath.split("/", 1)[0] for relpath in self.runs})

    def to_json(self) -> Dict:
        return {
            "cpu": self.cpu,
            "of": self.of,
            "steps": self.steps,
            "runs": self.runs,
            "reproduced": self.reproduced,
            "date": self.date,
            "commands": self.commands,
            "torch": self.torch,
        }

    @staticmethod
    def from_json(data: Dict) -> "Reproduction":
        runs = {_renamed(relpath): None if step is None else int(step) for relpath, step in data["runs"].items()}
        return Reproduction(
            data["cpu"], data["of"], int(data["steps"]), runs, data["date"], list(data["commands"]), data["torch"]
        )


def _renamed(relpath: str) -> str:
    """A run's relpath (``<condition>/<arm>/seed-<s>``) with its arm by its name now (records of old names)."""
    condition, arm, seed = relpath.split("/")
    return f"{condition}/{canonical_arm(arm)}/{seed}"


def first_difference(original: RunResult, retrained: Dict[str, Series], steps: int) -> Optional[int]:
    """The first of steps 1..``steps`` at which the retrained run's :data:`CHECKED` scalars (``{name:
    series}``, as :func:`studies.ablation.runs.kept_scalars` reads them) differ from ``original``'s summary, to
    its 7 digits (the digest exactly); a step either lacks counts as differing. None when none differs."""
    for name in CHECKED:
        if not original.series(name):
            raise ValueError(f"{original.key.relpath}: its summary has no {name} to check a retraining against")
    theirs = {name: dict(original.series(name)) for name in CHECKED}
    mine = {name: dict(retrained.get(name, [])) for name in CHECKED}
    for step in range(1, steps + 1):
        for name in CHECKED:
            a, b = theirs[name].get(step), mine[name].get(step)
            if a is None or b is None:
                return step
            if name == "batch_digest":
                if int(a) != int(b):
                    return step
            elif not (math.isnan(a) and math.isnan(b)) and seven_digits(b) != a:
                return step
    return None


def read_reproductions(summaries: Path) -> List[Reproduction]:
    """Every reproduction recorded beside the summaries (none when the file is absent)."""
    data = read_json(summaries / CPUS_FILE) or {}
    return [Reproduction.from_json(entry) for entry in data.get("reproductions", [])]


def write_reproduction(summaries: Path, reproduction: Reproduction) -> Path:
    """Record ``reproduction`` in ``<summaries>/cpus.json``, in place of an earlier one of the same two CPUs,
    torch and conditions."""

    def same(r: Reproduction) -> Tuple:
        return r.cpu, r.of, r.torch, r.conditions

    kept = [r for r in read_reproductions(summaries) if same(r) != same(reproduction)]
    path = summaries / CPUS_FILE
    write_json_atomic(path, {"reproductions": [r.to_json() for r in [*kept, reproduction]]})
    return path


def computes_as(summaries: Path, condition: str, torch: str) -> Dict[str, str]:
    """``{cpu: the name its runs of ``condition`` with ``torch`` count as made on}``: the CPUs joined by the
    records that matched at every step of runs of that condition with that torch, joined transitively (a CPU
    that reproduced B, and B that reproduced A, count as one with A, whichever way each record points), each
    group named by its first CPU in sorted order, every member mapped, that one too. Empty without a record."""
    parent: Dict[str, str] = {}

    def root(cpu: str) -> str:
        while parent.setdefault(cpu, cpu) != cpu:
            cpu = parent[cpu]
        return cpu

    for r in read_reproductions(summaries):
        if r.reproduced and r.torch == torch and condition in r.conditions:
            a, b = root(r.cpu), root(r.of)
            parent[max(a, b)] = min(a, b)
    return {cpu: root(cpu) for cpu in list(parent)}
