"""What every heading of the ablation's report shares: the report's setup (:class:`ReportSetup`), words
for a WER and a count, the CPU and wall-time sentences, and icefall's published numbers (a data file)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from studies.ablation.arms import Thresholds
from studies.ablation.cpus import Reproduction
from studies.ablation.family import (
    StudyConfig,
)
from studies.ablation.pairing import NOT_RECORDED, cpu_name
from studies.ablation.replay.result import ReplayResult
from studies.ablation.runs import RunResult

# icefall's own ablation of the filter, with its source (a data file: not measured here).
ICEFALL_PUBLISHED = Path(__file__).parents[1] / "icefall_published.json"


def icefall_published() -> Dict:
    return json.loads(ICEFALL_PUBLISHED.read_text(encoding="utf-8"))


def icefall_greedy() -> Dict[str, Tuple[float, float]]:
    """``{arm: (test-clean, test-other)}``: icefall's published greedy-search WERs without and with the filter."""
    data = icefall_published()
    return {arm: (wers["test-clean"], wers["test-other"]) for arm, wers in data["greedy_search"].items()}


@dataclass
class ReportSetup:
    """What the study says about its runs: the command, the round's configuration, where the summaries are and
    the settings stored with them, the thresholds, the decoding methods, the replays planned, the date and
    the machine of the report, and the CPUs shown to compute as others (:mod:`studies.ablation.cpus`)."""

    command: str
    config: StudyConfig
    summaries: str
    stored: Dict
    thresholds: Thresholds
    methods: Sequence[str]
    planned_replays: int
    date: str
    machine: str
    reproductions: Sequence[Reproduction] = ()
    waiting: Sequence[str] = ()  # runs trained to fewer steps than their condition's budget: "<relpath> (n of N)"


def wer_name(method: str, test_set: str) -> str:
    return f"{method.replace('_search', '')} {test_set}"


def cpu_line(results: Sequence[RunResult], replays: Sequence[ReplayResult]) -> str:
    counts: Dict[str, int] = {}
    for r in [*results, *replays]:
        name = cpu_name(r.machine) or NOT_RECORDED
        counts[name] = counts.get(name, 0) + 1
    return "; ".join(f"{name}: {n} run(s)/replay(s)" for name, n in sorted(counts.items()))


def reproductions_sentence(reproductions: Sequence[Reproduction], summaries: str) -> str:
    """What each check of one CPU against another's runs found (empty without one)."""
    parts = []
    for r in reproductions:
        found = (
            f"with torch {r.torch} reproduced every one of the first {r.steps} steps of "
            f"{plural(len(r.runs), 'run', 'runs')} made on {r.of} ({', '.join(sorted(r.runs))}: batch digest, "
            "losses and gradient norm to the summaries' 7 digits), so on "
            f"{', '.join(f'`{c}`' for c in r.conditions)} its runs pair with that CPU's (the other seeds, the later "
            "steps and the decodings are assumed to reproduce too, not checked)"
            if r.reproduced
            else f"with torch {r.torch} did not reproduce runs made on {r.of} ("
            + ", ".join(
                f"{relpath} {'matched' if step is None else f'parts at step {step}'}"
                for relpath, step in sorted(r.runs.items())
            )
            + f", of {r.steps} steps retrained): its runs do not pair with that CPU's"
        )
        parts.append(f"On {r.date}, {r.cpu} {found}")
    if not parts:
        return ""
    return " " + "; ".join(parts) + f" (`{summaries}/cpus.json`, `ablation.py --verify-cpu`)."


def fixed_before(setup: StudyConfig, stored: Dict) -> bool:
    """Whether the summaries are of the round whose family was fixed before its runs."""
    return stored.get("round") == setup.round


def round_note(setup: StudyConfig, stored: Dict) -> str:
    if fixed_before(setup, stored):
        return (
            f"The family, its test and the seed counts were fixed on {setup.fixed} before the runs of round "
            f"{setup.round} (`studies/ablation/family.json`)."
        )
    return (
        f"These runs predate the family (fixed on {setup.fixed} for round {setup.round}, "
        "`studies/ablation/family.json`): its comparisons are computed here after the fact, as descriptions."
    )


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def wall_sentence(runs: Sequence[RunResult], replays: Sequence[ReplayResult]) -> str:
    """The wall time their summaries recorded (training and decoding; time paused inside a segment counts), in
    hours, and how many recorded none; empty when none did."""
    parts = []
    for what, items in (("runs", runs), ("replays", replays)):
        timed = [x.wall_total_s for x in items if x.wall_s]
        if timed:
            missing = len(items) - len(timed)
            parts.append(
                f"{sum(timed) / 3600:.2f} h for {plural(len(timed), what[:-1], what)}"
                + (f" ({missing} recorded none)" if missing else "")
            )
    if not parts:
        return ""
    return f"Recorded wall time (training and decoding): {' and '.join(parts)}. "


def time_lines(runs: Sequence[RunResult]) -> List[str]:
    """A set's own paragraph of the wall and CPU time its runs recorded, then a blank line; none when they
    recorded no time."""
    text = (wall_sentence(runs, []) + cpu_sentence(runs)).strip()
    return [text, ""] if text else []


def cpu_sentence(runs: Sequence[RunResult]) -> str:
    """The CPU time of the runs whose summaries hold it in full (user + system of their training and
    decoding processes; replays record none), beside those runs' wall time; empty when none does."""
    counted = [(r.cpu_total_s, r.wall_total_s) for r in runs if r.cpu_total_s is not None]
    if not counted:
        return ""
    cpu, wall = (sum(x) for x in zip(*counted))
    others = len(runs) - len(counted)
    why = f" ({others} ran before it was recorded, or had a segment cut off)" if others else ""
    return (
        f"CPU time of the runs (user + system of their training and decoding processes), recorded in full for "
        f"{len(counted)} of {plural(len(runs), 'run', 'runs')}{why}: {cpu / 3600:.2f} h in the "
        f"{wall / 3600:.2f} h of wall time those runs recorded. "
    )
