"""The replays chosen: the branches and their labels, an outlier event of a run, the replays of a run's
largest events (windows that do not overlap) and branch (d)'s matched start for each."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from studies.ablation.runs import RunResult
from studies.ablation.settings import FILTER_ARM, OBSERVING_ARM

NO_CONTROL = "none"


EVENT_ONLY = "event-only"


FILTER = "filter"


MATCHED = "matched"


UNIFORM = "uniform"


MATCHED_REFERENCE = "matched-none"  # the run itself over the matched window (decoded at its end)


# The branches trained from the event's start: the control of the event step, then of the rest of the window.
# A control is an arm name, or UNIFORM (the filter arm's threshold with train.py's --grad-filter-mode uniform).
FROM_EVENT: Dict[str, Tuple[str, str]] = {
    NO_CONTROL: (OBSERVING_ARM, OBSERVING_ARM),
    EVENT_ONLY: (FILTER_ARM, OBSERVING_ARM),
    FILTER: (FILTER_ARM, FILTER_ARM),
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
