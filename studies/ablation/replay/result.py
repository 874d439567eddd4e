"""A finished replay: its branches as measured (losses, batch digests, WERs, second moments), its summary
written and read back, branch (a) checked against the run, and the second moments grouped by layer."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.data.features import NUM_MEL_BINS
from icefall_lite.nn.model import add_model_arguments, build_transducer, model_config_from_args
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.train.tb_tags import TrainingScalarTags
from studies.ablation.arms import RunKey
from studies.ablation.metrics import largest_jump, steps_filtered
from studies.ablation.replay.events import (
    FROM_EVENT,
    MATCHED,
    MATCHED_REFERENCE,
    NO_CONTROL,
    Event,
    Matched,
    ReplayKey,
)
from studies.ablation.runs import RunResult, kept_scalars, summary_path
from studies.runner import read_json, read_wers
from studies.tb_reader import Series, read_scalars


@dataclass
class Branch:
    """What one branch measured over its window: the objective per step, batch digests, WERs at the end, the
    fraction of steps some layer filtered, the largest second-moment jump, and every parameter tensor's
    ``exp_avg_sq`` summed, in the optimizer's order, at the end and (branches from the event) after the
    event step."""

    objective: Series
    digests: Series
    wer: Dict[Tuple[str, str], float]
    filtered: float
    largest_jump: float
    second_moment: List[float] = field(default_factory=list)
    second_moment_event: List[float] = field(default_factory=list)

    def mean_loss(self, first: Optional[int] = None) -> float:
        xs = [v for _, v in self.objective[:first] if math.isfinite(v)]
        return sum(xs) / len(xs) if xs else float("nan")

    def to_json(self) -> Dict:
        return {
            "objective": [[s, v] for s, v in self.objective],
            "digests": [[s, v] for s, v in self.digests],
            "wer": [[m, t, v] for (m, t), v in self.wer.items()],
            "filtered": self.filtered,
            "largest_jump": self.largest_jump,
            "second_moment": self.second_moment,
            "second_moment_event": self.second_moment_event,
        }

    @staticmethod
    def from_json(b: Dict) -> "Branch":
        return Branch(
            [(int(s), float(v)) for s, v in b["objective"]],
            [(int(s), float(v)) for s, v in b["digests"]],
            {(m, t): v for m, t, v in b["wer"]},
            float(b["filtered"]),
            float(b["largest_jump"]),
            [float(x) for x in b["second_moment"]],
            [float(x) for x in b.get("second_moment_event", [])],
        )


def second_moment_sums(checkpoint: Path) -> List[float]:
    """Every parameter tensor's ``exp_avg_sq``, summed, in the optimizer's order, from a checkpoint."""
    state = load_checkpoint_file(checkpoint)["optimizer"]["state"]
    return [
        float(state[i]["exp_avg_sq"].double().sum()) if "exp_avg_sq" in state[i] else float("nan")
        for i in sorted(state, key=int)
    ]


def collect_branch(
    branch_dir: Path,
    key: RunKey,
    end: int,
    methods: Sequence[str],
    tags: TrainingScalarTags,
    event_step: Optional[int] = None,
) -> Branch:
    """Read a finished branch (``key``: the branch as a run): its TensorBoard scalars with the batch digests, its
    WERs, and the second moments at step ``end`` (and at ``event_step``, when given)."""
    scalars, filters = kept_scalars(read_scalars(branch_dir / "tensorboard"), tags, extra=("batch_digest",))
    run = RunResult(key, read_wers(branch_dir, methods), scalars, filters)
    return Branch(
        objective=run.objective(),
        digests=run.series("batch_digest"),
        wer=run.wer,
        filtered=steps_filtered(run),
        largest_jump=largest_jump(run),
        second_moment=second_moment_sums(branch_dir / f"checkpoint-{end}.pt"),
        second_moment_event=[]
        if event_step is None
        else second_moment_sums(branch_dir / f"checkpoint-{event_step}.pt"),
    )


@dataclass
class ReplayResult:
    """A finished replay: the event, the window length, the branches (:data:`LABELS`; the matched branch and
    its reference when a matched step was found), the parameter tensors ``(name, elements)`` in the
    optimizer's order, the machine (empty when not recorded), the commands that made it and the wall seconds
    per phase summed over its folders (``train``, ``decode/<method>``; empty when not recorded)."""

    key: ReplayKey
    event: Event
    steps: int
    branches: Dict[str, Branch]
    tensors: List[Tuple[str, int]] = field(default_factory=list)
    matched: Optional[Matched] = None
    machine: Dict[str, str] = field(default_factory=dict)
    commands: List[str] = field(default_factory=list)
    wall_s: Dict[str, float] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.key.start + self.steps

    @property
    def wall_total_s(self) -> float:
        """Wall seconds recorded over every phase (0 when none was)."""
        return sum(self.wall_s.values())

    @property
    def identical_batches(self) -> bool:
        """Every branch from the event logged the same batch digest at every step of the window (and some);
        the matched branch the same as its reference where both logged them."""
        from_event = [self.branches[b].digests for b in FROM_EVENT if b in self.branches]
        same = len(from_event[0]) == self.steps and all(d == from_event[0] for d in from_event)
        if MATCHED in self.branches and MATCHED_REFERENCE in self.branches:
            reference = dict(self.branches[MATCHED_REFERENCE].digests)
            same = same and all(reference.get(s, d) == d for s, d in self.branches[MATCHED].digests)
        return same

    def to_json(self) -> Dict:
        return {
            "key": {"condition": self.key.condition, "seed": self.key.seed, "start": self.key.start},
            "event": {"step": self.event.step, "layer": self.event.layer, "ratio": self.event.ratio},
            "steps": self.steps,
            "matched": None if self.matched is None else {"start": self.matched.start, "ratio": self.matched.ratio},
            "tensors": [[name, n] for name, n in self.tensors],
            "machine": self.machine,
            "commands": self.commands,
            "wall_s": self.wall_s,
            "branches": {name: b.to_json() for name, b in self.branches.items()},
        }

    @staticmethod
    def from_json(data: Dict) -> "ReplayResult":
        matched = data.get("matched")
        return ReplayResult(
            ReplayKey(**data["key"]),
            Event(**data["event"]),
            int(data["steps"]),
            {name: Branch.from_json(b) for name, b in data["branches"].items()},
            [(name, int(n)) for name, n in data.get("tensors", [])],
            None if matched is None else Matched(int(matched["start"]), float(matched["ratio"])),
            dict(data.get("machine", {})),
            list(data.get("commands", [])),
            {phase: float(v) for phase, v in data.get("wall_s", {}).items()},
        )


@dataclass(frozen=True)
class Reproduction:
    """Branch (a) against the original run over the window: the window's steps, those the run has (a window of
    round 1 could run past the run's budget), and those of them at which the losses agree to the 6
    significant digits that survive a summary's rounding."""

    window: int
    in_run: int
    same: int

    @property
    def every_step(self) -> bool:
        """Checked and equal at every step of the window."""
        return self.same == self.in_run == self.window

    def describe(self) -> str:
        if self.every_step:
            return f"yes, at all {self.window} steps"
        if self.same < self.in_run:
            return f"NO: differs at {self.in_run - self.same} of {self.in_run} steps"
        return f"not checked at every step: the run has {self.in_run} of the {self.window} (all equal)"


def reproduction(replay: ReplayResult, original: RunResult) -> Reproduction:
    """Branch (a)'s losses against the original run's at every step of the window."""
    by_step = dict(original.objective())
    mine = dict(replay.branches[NO_CONTROL].objective)
    window = range(replay.key.start + 1, replay.end + 1)
    in_run = [s for s in window if s in by_step]
    same = sum(1 for s in in_run if s in mine and math.isclose(mine[s], by_step[s], rel_tol=1e-6))
    return Reproduction(len(window), len(in_run), same)


def reproduces(replay: ReplayResult, original: RunResult) -> bool:
    """Whether branch (a) has the original run's loss at every step of the window (all checked)."""
    return reproduction(replay, original).every_step


def read_replay_summary(summaries_dir: Path, key: ReplayKey) -> Optional[ReplayResult]:
    """The summary of the replay ``key`` (None when it has none)."""
    data = read_json(summary_path(summaries_dir, key))
    return None if data is None else ReplayResult.from_json(data)


def read_replay_summaries(summaries_dir: Path, condition: str) -> List[ReplayResult]:
    """Every replay summary of ``condition``, by seed and start."""
    out = [ReplayResult.from_json(read_json(p)) for p in (summaries_dir / condition / "replays").glob("*.json")]
    return sorted(out, key=lambda r: (r.key.seed, r.key.start))


def parameter_layout(model_flags: Sequence[str], vocab_size: int = 500) -> List[Tuple[str, int]]:
    """``(name, elements)`` of every parameter of the model the flags build, in the optimizer's order (the
    vocabulary size changes elements, not which tensors have one element)."""
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(list(model_flags))
    model = build_transducer(
        **model_config_from_args(args, vocab_size=vocab_size, blank_id=0, num_features=NUM_MEL_BINS)
    )
    return [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]


def layer_of(name: str) -> str:
    """The layer a parameter belongs to, for the per-layer second moments: ``encoder layer <i>``, ``encoder
    embedding``, ``decoder``, ``joiner`` or ``simple projections``."""
    m = re.match(r"encoder\.encoder\.layers\.(\d+)\.", name)
    if m:
        return f"encoder layer {m.group(1)}"
    if name.startswith("encoder."):
        return "encoder embedding"
    if name.startswith("simple_"):
        return "simple projections"
    return name.split(".", 1)[0]


def layer_ratios(
    tensors: Sequence[Tuple[str, int]], numerator: Sequence[float], denominator: Sequence[float]
) -> Dict[str, float]:
    """Per layer, over its tensors of more than one element: the sum of ``numerator``'s second moments over
    the sum of ``denominator``'s (one-element tensors, the log-scales and BasicNorm's eps, are left out: their
    ratios say nothing of a layer's step sizes). Empty when the lists do not match the tensors."""
    if not tensors or len(numerator) != len(tensors) or len(denominator) != len(tensors):
        return {}
    sums: Dict[str, List[float]] = {}
    for (name, elements), a, b in zip(tensors, numerator, denominator):
        if elements > 1 and math.isfinite(a) and math.isfinite(b):
            pair = sums.setdefault(layer_of(name), [0.0, 0.0])
            pair[0] += a
            pair[1] += b
    return {layer: a / b for layer, (a, b) in sums.items() if b > 0}
