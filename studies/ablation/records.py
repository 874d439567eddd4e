"""The plain records of the ablation, at the bottom of its imports: a run's key (:class:`RunKey`) and what a
finished run measured (:class:`RunResult`), with the full JSON form a run summary had before the per-step series
moved to a file of their own (:mod:`studies.ablation.compact`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from studies.ablation.arm_names import canonical_arm
from studies.tb_reader import Series, seven_digits

# The losses of the report are of the transducer objective after warm-up, 0.5 x simple + pruned per frame,
# whatever weights the warm-up ramp gave them at the step.
OBJECTIVE_SIMPLE_SCALE = 0.5
# A summary's per-step largest fraction over layers of the frame rows the recurrent cap clipped, and of the
# layer output's gradient elements the error clip clipped (TrainingScalarTags fields of per-layer tags).
RECURRENT_CLIP = "recurrent_clip"
ERROR_CLIP = "error_clip"
# The scalars a run summary keeps (TrainingScalarTags fields).
KEPT_SCALARS = (
    "simple_loss",
    "pruned_loss",
    "grad_norm",
    "clip_scale",
    "skipped_steps",
    "valid_loss",
    "exp_avg_sq_jump",
    "exp_avg_sq_recovery",
)
KEPT_FILTER_STATS = ("max_over_median", "fraction_filtered")
# Scalars a summary keeps exactly (not to 7 significant digits): the batch digests, compared step by step.
EXACT_SCALARS = ("batch_digest",)


@dataclass(frozen=True)
class RunKey:
    """One training run: a condition, an arm, a seed."""

    condition: str
    arm: str
    seed: int

    @property
    def relpath(self) -> str:
        return f"{self.condition}/{self.arm}/seed-{self.seed}"


@dataclass
class RunResult:
    """What one finished run (condition x arm x seed) measured.

    ``wer``: at the end of the budget; ``wer_at``: ``{step: {(method, test set): WER}}`` at every point the
    run was decoded (``decoding``: how, e.g. ``{"avg": 2, "use_averaged_model": true}``; empty in summaries
    written before runs were decoded at several points: then the end only, ``--avg 1``). ``scalars``:
    ``{TrainingScalarTags field: series}`` (:data:`KEPT_SCALARS`); ``filters``: ``{(layer, stat): series}`` of
    the per-layer GradientFilter statistics (the observing filter's too); ``warm_end``: the first step at the
    full loss weights; ``machine``: the CPU model, flags digest, threads and torch version it ran on (empty in
    summaries written before they were recorded); ``commands``: the commands that made it, as typed from the
    recipe folder (empty in older summaries); ``cpu_s``: CPU seconds per phase of the phases recorded in full
    (:func:`studies.ablation.runs.cpu_time_recorded`; empty in older summaries); ``computes_as``: the name of
    the CPUs ``machine``'s CPU was shown to compute as (:mod:`studies.ablation.cpus`; set when the summary is
    read, not stored in it), else None.
    """

    key: RunKey
    wer: Dict[Tuple[str, str], float]
    scalars: Dict[str, Series]
    filters: Dict[Tuple[int, str], Series] = field(default_factory=dict)
    wall_s: Dict[str, float] = field(default_factory=dict)
    warm_end: int = 0
    machine: Dict[str, str] = field(default_factory=dict)
    wer_at: Dict[int, Dict[Tuple[str, str], float]] = field(default_factory=dict)
    decoding: Dict = field(default_factory=dict)
    commands: List[str] = field(default_factory=list)
    cpu_s: Dict[str, float] = field(default_factory=dict)
    computes_as: Optional[str] = None

    def series(self, name: str) -> Series:
        return self.scalars.get(name, [])

    @property
    def wall_total_s(self) -> float:
        """Wall seconds recorded over every phase (0 when none was)."""
        return sum(self.wall_s.values())

    @property
    def cpu_total_s(self) -> Optional[float]:
        """CPU seconds over every phase, when each phase that took wall time has its CPU time recorded in full
        (:func:`studies.ablation.runs.cpu_time_recorded`); else None."""
        timed = [phase for phase, seconds in self.wall_s.items() if seconds > 0]
        if not timed or any(phase not in self.cpu_s for phase in timed):
            return None
        return sum(self.cpu_s[phase] for phase in timed)

    @property
    def steps(self) -> int:
        grad_norm = self.series("grad_norm")
        return grad_norm[-1][0] if grad_norm else 0

    def objective(self) -> Series:
        """``[(step, 0.5 x simple + pruned loss per frame)]`` at every step from 1: the training objective with
        its weights after warm-up, during warm-up too."""
        pruned = dict(self.series("pruned_loss"))
        return [
            (step, OBJECTIVE_SIMPLE_SCALE * simple + pruned[step])
            for step, simple in self.series("simple_loss")
            if step in pruned
        ]

    def layers(self) -> List[int]:
        return sorted({layer for layer, _ in self.filters})

    def filter_series(self, layer: int, stat: str) -> Series:
        return self.filters.get((layer, stat), [])

    def largest_ratio_per_step(self) -> Series:
        """``[(step, max over layers of max/median)]``."""
        by_step: Dict[int, float] = {}
        for layer in self.layers():
            for step, v in self.filter_series(layer, "max_over_median"):
                by_step[step] = max(by_step.get(step, v), v)
        return sorted(by_step.items())

    def to_json(self) -> Dict:
        """The full form: every field, the series inline (7 significant digits, the batch digests exact)."""
        fields = list(self.to_json_without_series().items())
        series = {
            "scalars": {k: _exact(v) if k in EXACT_SCALARS else _rounded(v) for k, v in self.scalars.items()},
            "filters": [[layer, stat, _rounded(v)] for (layer, stat), v in self.filters.items()],
        }
        return dict(fields[:4] + list(series.items()) + fields[4:])  # the order summaries were written in

    def to_json_without_series(self) -> Dict:
        """Every field but the per-step series (``scalars``, ``filters``), in the full form's order."""
        return {
            "key": {"condition": self.key.condition, "arm": self.key.arm, "seed": self.key.seed},
            "wer": [[m, t, v] for (m, t), v in self.wer.items()],
            "wer_at": [[step, m, t, v] for step, wers in sorted(self.wer_at.items()) for (m, t), v in wers.items()],
            "decoding": self.decoding,
            "wall_s": self.wall_s,
            "warm_end": self.warm_end,
            "machine": self.machine,
            "commands": self.commands,
            "cpu_s": self.cpu_s,
        }

    @staticmethod
    def from_json(
        data: Dict,
        scalars: Optional[Dict[str, Series]] = None,
        filters: Optional[Dict[Tuple[int, str], Series]] = None,
    ) -> "RunResult":
        """A run from its full form, or from the form without series (``data`` has no ``scalars``) and its
        series, ``scalars`` and ``filters``, read from their own file; its arm by its name now
        (:mod:`studies.ablation.arm_names`)."""
        wer_at: Dict[int, Dict[Tuple[str, str], float]] = {}
        for step, m, t, v in data.get("wer_at", []):
            wer_at.setdefault(int(step), {})[(m, t)] = v
        if scalars is None or filters is None:
            scalars = {k: [(int(s), float(v)) for s, v in series] for k, series in data["scalars"].items()}
            filters = {
                (int(layer), stat): [(int(s), float(v)) for s, v in series] for layer, stat, series in data["filters"]
            }
        key = data["key"]
        return RunResult(
            RunKey(key["condition"], canonical_arm(key["arm"]), key["seed"]),
            {(m, t): v for m, t, v in data["wer"]},
            scalars,
            filters,
            dict(data["wall_s"]),
            int(data["warm_end"]),
            dict(data.get("machine", {})),
            wer_at,
            dict(data.get("decoding", {})),
            list(data.get("commands", [])),
            dict(data.get("cpu_s", {})),
        )


def _exact(series: Series) -> List[List[float]]:
    """Integer-valued scalars (batch digests: 24-bit, exact as float32) kept as integers."""
    return [[s, int(v)] for s, v in series]


def _rounded(series: Series) -> List[List[float]]:
    """:func:`studies.tb_reader.seven_digits`; non-finite values as strings."""
    return [[s, seven_digits(v) if math.isfinite(v) else str(v)] for s, v in series]
