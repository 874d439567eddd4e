"""Replayed outlier events with controls: what does the GradientFilter do at an outlier, beyond what switching
it on does anyway?

In a run of the arm without control (its filter only observing), an *event* is a step after warm-up at which
some encoder layer's largest per-sequence gradient RMS is above the filter's threshold times the batch
median. A replay resumes the run at the step just before the event (from its nearest earlier checkpoint,
trained on without control up to that step: the prefix) and trains the window on the same batches
(train.py's exact resume) in branches that differ only in the gradient control:

  (a) ``none``        no control: must reproduce the run at every step of the window (checked);
  (b) ``event-only``  the filter on the event step only, no control after it;
  (c) ``filter``      the filter on over the whole window;
  (d) ``matched``     the filter switched on, for a window as long, at a checkpoint step of the same run whose
                      first step has no outlier (every layer under the matched maximum, 5x the median), its
                      window clear of every replayed event's window and of the other replays' (d), compared
                      with the run itself over that window (its checkpoint at the window's end decoded as the
                      reference);
  (e) ``uniform``     the filter's mean scale applied to every sequence alike, no per-sequence capping
                      (:mod:`studies.ablation.uniform_filter`).

(b) against (c) tells whether the gain comes from filtering the event or from the filter staying on; (d)
whether switching the filter on helps without an event (a transient cut of Adam's step size, whose second
moment was built on unfiltered gradients); (e) whether capping matters beyond that cut. Each branch is decoded
at the window's end; the per-layer Adam second moments (``exp_avg_sq`` summed over each layer's tensors of
more than one element) are compared at the event step and at the window's end.

The study (:mod:`studies.ablation.study`) runs the branches; this module chooses the events, reads the
branches back, summarises them and writes the report's replay tables.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from icefall_lite.data.features import NUM_MEL_BINS
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.nn.model import add_model_arguments, build_transducer, model_config_from_args
from icefall_lite.train.checkpoint import load_checkpoint_file
from icefall_lite.train.tb_tags import TrainingScalarTags
from studies.ablation.arms import RunKey
from studies.ablation.markdown import markdown_table
from studies.ablation.metrics import largest_jump, steps_filtered
from studies.ablation.paired import PairedDifference, paired_difference
from studies.ablation.runs import RunResult, kept_scalars, summary_path
from studies.runner import read_json, read_wers
from studies.tb_reader import Series, read_scalars

NO_CONTROL = "none"
EVENT_ONLY = "event-only"
FILTER = "filter"
MATCHED = "matched"
UNIFORM = "uniform"
MATCHED_REFERENCE = "matched-none"  # the run itself over the matched window (decoded at its end)
# The branches trained from the event's start: the control of the event step, then of the rest of the window.
# A control is an arm name, or UNIFORM (studies.ablation.uniform_filter at the filter arm's threshold).
FROM_EVENT: Dict[str, Tuple[str, str]] = {
    NO_CONTROL: ("none", "none"),
    EVENT_ONLY: ("filter", "none"),
    FILTER: ("filter", "filter"),
    UNIFORM: (UNIFORM, UNIFORM),
}
LABELS = {
    NO_CONTROL: "(a) no control",
    EVENT_ONLY: "(b) filter on the event step only",
    FILTER: "(c) filter over the window",
    MATCHED: "(d) filter from a step without outlier, elsewhere in the run",
    UNIFORM: "(e) filter's mean scale, uniform, no capping",
}
# The controls (b)-(e) against their no-control reference, in report order.
CONTROLS = (EVENT_ONLY, FILTER, MATCHED, UNIFORM)
EARLY_STEPS = 10  # the first steps of the window, reported apart (does a gain appear at once or build up?)


@dataclass(frozen=True)
class ReplayKey:
    """One replay of the ``none`` run of ``condition``/``seed``: the branches from the event resume at step
    ``start``, the step just before the event."""

    condition: str
    seed: int
    start: int

    @property
    def relpath(self) -> str:
        return f"{self.condition}/replays/seed-{self.seed}-from-{self.start}"


@dataclass(frozen=True)
class Event:
    """An outlier step: its step, its largest layer and that layer's max/median."""

    step: int
    layer: int
    ratio: float


@dataclass(frozen=True)
class Matched:
    """Branch (d)'s start: a checkpoint step of the run whose next step's largest max/median (any layer) is
    ``ratio``."""

    start: int
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


def _overlap(a: int, b: int, window: int) -> bool:
    """Whether the windows ``(a, a + window]`` and ``(b, b + window]`` share a step."""
    return abs(a - b) < window


def choose_replays(result: RunResult, threshold: float, window: int, count: int) -> List[Tuple[int, Event]]:
    """Up to ``count`` replays of ``result``'s events, largest first: ``(start, event)`` with ``start =
    event.step - 1``, each window ``(start, start + window]`` inside the run (so that branch (a) is checked at
    every step) and not overlapping another chosen one; in step order."""
    chosen: List[Tuple[int, Event]] = []
    candidates = [e for e in find_events(result, threshold) if e.step - 1 + window <= result.steps]
    for event in sorted(candidates, key=lambda e: (-e.ratio, e.step)):
        if len(chosen) == count:
            break
        if all(not _overlap(event.step - 1, start, window) for start, _ in chosen):
            chosen.append((event.step - 1, event))
    return sorted(chosen)


def largest_ratio_at(result: RunResult, step: int) -> float:
    """The largest max/median over layers at ``step`` (nan when not logged)."""
    xs = [v for layer in result.layers() for s, v in result.filter_series(layer, "max_over_median") if s == step]
    return max(xs) if xs else math.nan


def matched_start(
    result: RunResult,
    event_start: int,
    window: int,
    save_every: int,
    max_ratio: float,
    taken: Sequence[int] = (),
) -> Optional[Matched]:
    """Branch (d)'s start for the event replayed from ``event_start``: the checkpoint step ``c`` (a multiple of
    ``save_every``, after warm-up, its window inside the run and overlapping neither the event's nor a window
    starting at a step of ``taken``) nearest ``event_start`` (the earlier on a tie) whose step ``c + 1`` has
    every layer under ``max_ratio``."""
    candidates = []
    for c in range(save_every * math.ceil(result.warm_end / save_every), result.steps - window + 1, save_every):
        if any(_overlap(c, other, window) for other in (event_start, *taken)):
            continue
        ratio = largest_ratio_at(result, c + 1)
        if math.isfinite(ratio) and ratio < max_ratio:
            candidates.append((abs(c - event_start), c, ratio))
    if not candidates:
        return None
    _, c, ratio = min(candidates)
    return Matched(c, ratio)


def matched_starts(
    result: RunResult, replays: Sequence[Tuple[int, Event]], window: int, save_every: int, max_ratio: float
) -> List[Optional[Matched]]:
    """Branch (d)'s start for each of a run's replays ``(start, event)`` (:func:`choose_replays`), in their
    order: each window clear of every replayed event's window and of the matched windows already chosen, the
    largest event choosing first (as the events were chosen), so that no two replays share a branch (d)."""
    event_starts = [start for start, _ in replays]
    chosen: Dict[int, Optional[Matched]] = {}
    for start, _ in sorted(replays, key=lambda r: (-r[1].ratio, r[1].step)):
        taken = [*event_starts, *(m.start for m in chosen.values() if m is not None)]
        chosen[start] = matched_start(result, start, window, save_every, max_ratio, taken)
    return [chosen[start] for start in event_starts]


# --------------------------------------------------------------------------
# A finished replay
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# The second moment per layer
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# The report's replay tables
# --------------------------------------------------------------------------


def per_seed_means(values: Sequence[Tuple[int, float]]) -> Dict[int, float]:
    """``{seed: mean of its events' values}`` (finite values): events of one run are averaged before any
    interval, so that a seed counts once."""
    by_seed: Dict[int, List[float]] = {}
    for seed, v in values:
        if math.isfinite(v):
            by_seed.setdefault(seed, []).append(v)
    return {seed: statistics.mean(xs) for seed, xs in sorted(by_seed.items())}


def over_seeds(values: Sequence[Tuple[int, float]]) -> PairedDifference:
    """The mean over seeds of the per-seed means of ``values`` (differences), its 95% interval and p (t on the
    seeds' means)."""
    means = per_seed_means(values)
    return paired_difference(means, {seed: 0.0 for seed in means})


@dataclass
class ReplayMeasures:
    """One control's differences from its no-control reference, per event ``(seed, value)``."""

    window_loss: List[Tuple[int, float]] = field(default_factory=list)
    early_loss: List[Tuple[int, float]] = field(default_factory=list)
    wer: Dict[Tuple[str, str], List[Tuple[int, float]]] = field(default_factory=dict)
    filtered: List[Tuple[int, float]] = field(default_factory=list)


def _window_objective(original: RunResult, start: int, steps: int) -> Branch:
    """The run itself over ``(start, start + steps]`` as a branch (its objective only)."""
    series = [(s, v) for s, v in original.objective() if start < s <= start + steps]
    return Branch(series, [], {}, math.nan, math.nan)


def control_measures(
    replays: Sequence[ReplayResult], originals: Dict[Tuple[str, int], RunResult], methods: Sequence[str]
) -> Dict[str, ReplayMeasures]:
    """Per control (b)-(e), per event, its difference from the reference: (a) for the branches from the event,
    the run over the matched window for (d). Replays whose branch (a) does not reproduce the run (or whose
    run summary is missing) are left out."""
    out = {name: ReplayMeasures() for name in CONTROLS}
    for r in replays:
        original = originals.get((r.key.condition, r.key.seed))
        if original is None or not reproduces(r, original):
            continue
        for name in CONTROLS:
            branch = r.branches.get(name)
            if branch is None:
                continue
            if name == MATCHED:
                reference = _window_objective(original, r.matched.start, r.steps)
                reference_wer = r.branches[MATCHED_REFERENCE].wer if MATCHED_REFERENCE in r.branches else {}
            else:
                reference = r.branches[NO_CONTROL]
                reference_wer = reference.wer
            m = out[name]
            m.window_loss.append((r.key.seed, branch.mean_loss() - reference.mean_loss()))
            m.early_loss.append((r.key.seed, branch.mean_loss(EARLY_STEPS) - reference.mean_loss(EARLY_STEPS)))
            m.filtered.append((r.key.seed, 100 * branch.filtered))
            for method in methods:
                for t in TEST_SETS:
                    k = (method, t)
                    if k in branch.wer and k in reference_wer:
                        m.wer.setdefault(k, []).append((r.key.seed, branch.wer[k] - reference_wer[k]))
    return {name: m for name, m in out.items() if m.window_loss}


def _cell(d: PairedDifference, digits: int) -> str:
    if d.n == 0:
        return "-"
    if d.n == 1:
        return f"{d.mean:+.{digits}f}"
    return f"{d.mean:+.{digits}f} {d.interval(digits)}"


def format_events_table(replays: Sequence[ReplayResult], originals: Dict[Tuple[str, int], RunResult]) -> str:
    """One row per replay: its seed, start, event, window, matched start, and the checks."""
    header = [
        "seed",
        "from step",
        "event step",
        "event layer",
        "max/median",
        "window",
        "matched from step",
        "max/median at its first step",
        "same batches",
        "(a) reproduces the run",
    ]
    rows = []
    for r in replays:
        original = originals.get((r.key.condition, r.key.seed))
        check = "run summary missing" if original is None else reproduction(r, original).describe()
        rows.append(
            [
                str(r.key.seed),
                str(r.key.start),
                str(r.event.step),
                str(r.event.layer),
                f"{r.event.ratio:.1f}",
                f"{r.key.start + 1}-{r.end}",
                "-" if r.matched is None else str(r.matched.start),
                "-" if r.matched is None else f"{r.matched.ratio:.2f}",
                "yes" if r.identical_batches else "NO",
                check,
            ]
        )
    return markdown_table(header, rows)


def format_controls_table(measures: Dict[str, ReplayMeasures], methods: Sequence[str]) -> str:
    """One row per control: its differences from the reference, averaged per seed first, mean [95% interval]
    over seeds."""
    wer_keys = [(m, t) for m in methods for t in TEST_SETS]
    header = (
        ["branch", "seeds", "events", "loss over the window", f"loss over its first {EARLY_STEPS} steps"]
        + [f"{m.replace('_search', '')} {t} at the window's end" for m, t in wer_keys]
        + ["% steps filtered"]
    )
    rows = []
    for name, m in measures.items():
        seeds = len(per_seed_means(m.window_loss))
        filtered = statistics.mean(v for _, v in m.filtered) if m.filtered else math.nan
        rows.append(
            [LABELS[name], str(seeds), str(len(m.window_loss)), _cell(over_seeds(m.window_loss), 4)]
            + [_cell(over_seeds(m.early_loss), 4)]
            + [_cell(over_seeds(m.wer.get(k, [])), 2) for k in wer_keys]
            + ["-" if math.isnan(filtered) else f"{filtered:.1f}"]
        )
    return markdown_table(header, rows)


def moment_columns(
    replays: Sequence[ReplayResult], layout: Callable[[ReplayResult], List[Tuple[str, int]]]
) -> Dict[str, List[Dict[str, float]]]:
    """Per column of the second-moment table, the per-layer ratios of every event that has them:
    ``(a) / x`` at the event step and at the window's end (above 1: the layer's second moment is larger
    without control), and the run over branch (d) at the matched window's end."""
    columns: Dict[str, List[Dict[str, float]]] = {}
    for r in replays:
        tensors = layout(r)
        none = r.branches[NO_CONTROL]
        for name in (FILTER, UNIFORM):
            if name in r.branches:
                ratios = layer_ratios(tensors, none.second_moment_event, r.branches[name].second_moment_event)
                if ratios:
                    columns.setdefault(f"event step: (a) / {LABELS[name][:3]}", []).append(ratios)
        for name in (EVENT_ONLY, FILTER, UNIFORM):
            if name in r.branches:
                ratios = layer_ratios(tensors, none.second_moment, r.branches[name].second_moment)
                if ratios:
                    columns.setdefault(f"window end: (a) / {LABELS[name][:3]}", []).append(ratios)
        if MATCHED in r.branches and MATCHED_REFERENCE in r.branches:
            ratios = layer_ratios(
                tensors, r.branches[MATCHED_REFERENCE].second_moment, r.branches[MATCHED].second_moment
            )
            if ratios:
                columns.setdefault("matched window end: run / (d)", []).append(ratios)
    return columns


def format_moment_table(columns: Dict[str, List[Dict[str, float]]]) -> str:
    """Rows: layers; cells: the median over events of the ratio, [smallest, largest]."""
    layers = sorted({layer for ratios in columns.values() for r in ratios for layer in r}, key=_layer_order)
    header = ["layer"] + [f"{name} (events)" for name in columns]
    rows = []
    for layer in layers:
        cells = [layer]
        for ratios in columns.values():
            xs = [r[layer] for r in ratios if layer in r]
            cells.append(f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}] ({len(xs)})" if xs else "-")
        rows.append(cells)
    return markdown_table(header, rows)


def _layer_order(layer: str) -> Tuple[int, str]:
    m = re.fullmatch(r"encoder layer (\d+)", layer)
    order = {"encoder embedding": -1}
    return (int(m.group(1)) if m else order.get(layer, 1000), layer)
