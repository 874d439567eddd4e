"""Replayed outlier events: the counterfactual test of the GradientFilter.

In a run of the arm without control (its filter only observing), an *event*
is a step after warm-up at which some encoder layer's largest per-sequence
gradient RMS is above the filter's threshold times the batch median. A replay
resumes the run at the step just before the event (from the run's nearest
earlier checkpoint, trained on without control up to that step) and trains
the same number of steps twice, on the same batches (train.py's exact
resume): a branch without the filter (which reproduces the original run) and
a branch with it, whose first step is the event. The branches differ only in
what the filter does (GradientFilter is soft: besides capping the outlier it
scales every sequence's gradient by ``c / (c + n_b)``), so the difference of
their losses over the window, of their optimizer state at its end and of
their WER is the effect of filtering from that event on.

The study (:mod:`studies.ablation.study`) runs the branches; this module chooses
the events, reads the branches back and summarises them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.train.tb_tags import TrainingScalarTags
from studies.ablation.arms import RunKey
from studies.ablation.metrics import largest_jump, steps_filtered
from studies.ablation.paired import PairedDifference, paired_difference
from studies.ablation.runs import RunResult, kept_scalars
from studies.runner import read_json, read_wers
from studies.tb_reader import Series, read_scalars

# The two branches of a replay, by the arm whose gradient controls they train with.
BRANCHES = ("none", "filter")


@dataclass(frozen=True)
class ReplayKey:
    """One replay of the ``none`` run of ``condition``/``seed``: both branches resume at step ``start``, the step
    just before the event."""

    condition: str
    seed: int
    start: int

    @property
    def relpath(self) -> str:
        return f"{self.condition}/replays/seed-{self.seed}-from-{self.start}"


@dataclass(frozen=True)
class Event:
    """The largest outlier in a replay's first checkpoint interval: its step, layer and max/median."""

    step: int
    layer: int
    ratio: float


def find_events(result: RunResult, threshold: float) -> List[Event]:
    """Every step after warm-up at which some layer's max/median is above ``threshold`` (its largest layer)."""
    best: Dict[int, Event] = {}
    for layer in result.layers():
        for step, ratio in result.filter_series(layer, "max_over_median"):
            if step > result.warm_end and math.isfinite(ratio) and ratio > threshold:
                if step not in best or ratio > best[step].ratio:
                    best[step] = Event(step, layer, ratio)
    return [best[s] for s in sorted(best)]


def choose_replays(result: RunResult, threshold: float, save_every: int, count: int) -> List[Tuple[int, Event]]:
    """Up to ``count`` replays of ``result``'s events: ``(start, event)`` with ``start = event.step - 1``; at
    most one event per checkpoint interval ``(k save_every, (k + 1) save_every]`` (its largest), the ``count``
    largest such events, in step order."""
    by_interval: Dict[int, Event] = {}
    for event in find_events(result, threshold):
        interval = (event.step - 1) // save_every
        if interval not in by_interval or event.ratio > by_interval[interval].ratio:
            by_interval[interval] = event
    chosen = sorted(by_interval.values(), key=lambda e: -e.ratio)[:count]
    return sorted((e.step - 1, e) for e in chosen)


@dataclass
class Branch:
    """What one branch measured over the window: the objective per step, batch digests, WERs, the fraction
    of steps some layer filtered, the largest second-moment jump, and the sum of every tensor's
    ``exp_avg_sq`` at the end (in the optimizer's parameter order)."""

    objective: Series
    digests: Series
    wer: Dict[Tuple[str, str], float]
    filtered: float
    largest_jump: float
    second_moment: List[float] = field(default_factory=list)

    def mean_loss(self) -> float:
        xs = [v for _, v in self.objective if math.isfinite(v)]
        return sum(xs) / len(xs) if xs else float("nan")


def collect_branch(branch_dir: Path, key: RunKey, end: int, methods: Sequence[str], tags: TrainingScalarTags) -> Branch:
    """Read a finished branch (``key``: the branch as a run): its TensorBoard scalars with the batch digests,
    its WERs, and the sum of every tensor's ``exp_avg_sq`` in its optimizer state at step ``end``."""
    scalars, filters = kept_scalars(read_scalars(branch_dir / "tensorboard"), tags, extra=("batch_digest",))
    run = RunResult(key, read_wers(branch_dir, methods), scalars, filters)
    state = load_checkpoint_file(branch_dir / f"checkpoint-{end}.pt")["optimizer"]["state"]
    return Branch(
        objective=run.objective(),
        digests=run.series("batch_digest"),
        wer=run.wer,
        filtered=steps_filtered(run),
        largest_jump=largest_jump(run),
        second_moment=[
            float(state[i]["exp_avg_sq"].double().sum()) if "exp_avg_sq" in state[i] else float("nan")
            for i in sorted(state, key=int)
        ],
    )


@dataclass
class ReplayResult:
    """A finished replay: the event, the window length and both branches."""

    key: ReplayKey
    event: Event
    steps: int
    branches: Dict[str, Branch]

    @property
    def identical_batches(self) -> bool:
        """Both branches logged the same batch digest at every step of the window (and logged some)."""
        a, b = (self.branches[name].digests for name in BRANCHES)
        return len(a) == self.steps and a == b

    def state_damage(self) -> float:
        """The largest ratio, over parameter tensors, of ``exp_avg_sq`` without the filter to with it at the
        end of the window (> 1: the unfiltered outlier left a larger second moment, i.e. smaller updates)."""
        pairs = zip(*(self.branches[name].second_moment for name in BRANCHES))
        ratios = [a / b for a, b in pairs if b > 0 and math.isfinite(a) and math.isfinite(b)]
        return max(ratios) if ratios else float("nan")

    def to_json(self) -> Dict:
        return {
            "key": {"condition": self.key.condition, "seed": self.key.seed, "start": self.key.start},
            "event": {"step": self.event.step, "layer": self.event.layer, "ratio": self.event.ratio},
            "steps": self.steps,
            "branches": {
                name: {
                    "objective": [[s, v] for s, v in b.objective],
                    "digests": [[s, v] for s, v in b.digests],
                    "wer": [[m, t, v] for (m, t), v in b.wer.items()],
                    "filtered": b.filtered,
                    "largest_jump": b.largest_jump,
                    "second_moment": b.second_moment,
                }
                for name, b in self.branches.items()
            },
        }

    @staticmethod
    def from_json(data: Dict) -> "ReplayResult":
        branches = {
            name: Branch(
                [(int(s), float(v)) for s, v in b["objective"]],
                [(int(s), float(v)) for s, v in b["digests"]],
                {(m, t): v for m, t, v in b["wer"]},
                float(b["filtered"]),
                float(b["largest_jump"]),
                [float(x) for x in b["second_moment"]],
            )
            for name, b in data["branches"].items()
        }
        return ReplayResult(
            ReplayKey(**data["key"]),
            Event(**data["event"]),
            int(data["steps"]),
            branches,
        )


def reproduces(replay: ReplayResult, original: RunResult) -> bool:
    """Whether the branch without the filter has the original run's losses at every step both have (the
    window may run past the run's budget), to the 6 significant digits that survive a summary's rounding."""
    by_step = dict(original.objective())
    shared = [(s, v) for s, v in replay.branches["none"].objective if s in by_step]
    return bool(shared) and all(math.isclose(v, by_step[s], rel_tol=1e-6) for s, v in shared)


def collect_replay(
    replay_dir: Path, key: ReplayKey, event: Event, steps: int, methods: Sequence[str], tags: TrainingScalarTags
) -> ReplayResult:
    """Read both branches of a finished replay (``<replay_dir>/<branch>``)."""
    end = key.start + steps
    branches = {
        name: collect_branch(replay_dir / name, RunKey(key.condition, name, key.seed), end, methods, tags)
        for name in BRANCHES
    }
    return ReplayResult(key, event, steps, branches)


def read_replay_summaries(summaries_dir: Path, condition: str) -> List[ReplayResult]:
    """Every replay summary of ``condition``, by seed and start."""
    out = [ReplayResult.from_json(read_json(p)) for p in (summaries_dir / condition / "replays").glob("*.json")]
    return sorted(out, key=lambda r: (r.key.seed, r.key.start))


# --------------------------------------------------------------------------
# The report's replay table
# --------------------------------------------------------------------------


def replay_differences(replays: Sequence[ReplayResult], methods: Sequence[str]) -> Dict[str, PairedDifference]:
    """Over events, ``filter - none``: the mean loss over the window and each WER at its end."""
    out = {
        "window loss": paired_difference(
            {i: r.branches["filter"].mean_loss() for i, r in enumerate(replays)},
            {i: r.branches["none"].mean_loss() for i, r in enumerate(replays)},
        )
    }
    for m in methods:
        for t in TEST_SETS:
            out[f"{m.replace('_search', '')} {t}"] = paired_difference(
                {i: r.branches["filter"].wer[(m, t)] for i, r in enumerate(replays)},
                {i: r.branches["none"].wer[(m, t)] for i, r in enumerate(replays)},
            )
    return out


def format_replay_table(
    replays: Sequence[ReplayResult], methods: Sequence[str], originals: Dict[Tuple[str, int], RunResult]
) -> str:
    """One row per replay: the event, both branches' window loss, jump, WERs, the state damage, and the
    checks (same batches; the unfiltered branch reproduces ``originals[(condition, seed)]``)."""
    wer_heads = [(m, t) for m in methods for t in TEST_SETS]
    header = (
        [
            "seed",
            "from step",
            "event (step, layer, max/median)",
            "window loss none / filter",
            "% steps filtered",
            "max exp_avg_sq jump none / filter",
            "exp_avg_sq none / filter at end (max over tensors)",
        ]
        + [f"{m.replace('_search', '')} {t} none / filter" for m, t in wer_heads]
        + ["same batches", "reproduces run"]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in replays:
        none, filt = r.branches["none"], r.branches["filter"]
        cells = [
            str(r.key.seed),
            f"{r.event.step}, {r.event.layer}, {r.event.ratio:.1f}",
            f"{none.mean_loss():.4f} / {filt.mean_loss():.4f}",
            f"{100 * filt.filtered:.1f}",
            f"{none.largest_jump:.2f} / {filt.largest_jump:.2f}",
            f"{r.state_damage():.2f}",
        ]
        cells += [f"{none.wer[k]:.2f} / {filt.wer[k]:.2f}" for k in wer_heads]
        original = originals.get((r.key.condition, r.key.seed))
        same_run = "-" if original is None else ("yes" if reproduces(r, original) else "NO")
        cells += ["yes" if r.identical_batches else "NO", same_run]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_state_damage(replays: Sequence[ReplayResult]) -> float:
    xs = [r.state_damage() for r in replays if math.isfinite(r.state_damage())]
    return statistics.median(xs) if xs else float("nan")
