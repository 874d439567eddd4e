"""The report written: every summary of the report's conditions read back, the plots drawn into
``<results-dir>/plots/`` and ``<results-dir>/README.md`` rendered (:mod:`~studies.ablation.report.render`)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from icefall_lite.utils import write_text_atomic
from studies.ablation.arms import CONDITIONS, RunKey
from studies.ablation.cpus import (
    read_reproductions,
)
from studies.ablation.metrics import format_table
from studies.ablation.plots import planned_plots
from studies.ablation.replay.result import (
    ReplayResult,
    read_replay_summaries,
)
from studies.ablation.report.common import ReportSetup
from studies.ablation.report.render import render_report
from studies.ablation.runs import (
    RunResult,
    read_summary,
    stored_runs,
)
from studies.ablation.settings import (
    CONFIG_FILE,
    OBSERVING_ARM,
    PILOT,
    Settings,
)
from studies.runner import (
    machine_summary,
    read_json,
    today,
)


def report_conditions(s: Settings) -> List[str]:
    """The conditions the report covers, in their table order whichever set writes it: this invocation's and
    every other known one with summaries (a set such as depth reports beside the round's runs, not instead)."""
    return [c for c in CONDITIONS if c in s.conditions or (s.summaries / c).is_dir()]


def finished_results(s: Settings) -> List[RunResult]:
    """Every summary of the report's conditions and every arm (any seed), in table order."""
    out = []
    for condition in report_conditions(s):
        for arm in s.arms:
            for key in stored_runs(s.summaries, condition, arm):
                result = read_summary(s.summaries, key)
                if result is not None:
                    out.append(result)
    return out


REPORT = "README.md"  # in --results-dir
PLOTS = "plots"  # <results-dir>/plots/
PROVENANCE = "provenance.md"  # in --results-dir, hand-written: copied at the report's end when present


@dataclass
class Report:
    """Everything a report is made from: the runs at their condition's budget, the replays, the pilots, the
    setup, the plots (``{kind: (path, draw)}``, not drawn yet) and the hand-written provenance."""

    results: List[RunResult]
    replays: List[ReplayResult]
    pilots: List[RunResult]
    setup: ReportSetup
    plots: Dict[str, Tuple[Path, Callable[[], Path]]]
    provenance: Optional[str]


def gather_report(
    s: Settings, command: str, date: Optional[str] = None, machine: Optional[str] = None
) -> Optional[Report]:
    """The report's inputs from every summary (None when no run is at its condition's budget); ``date`` and
    ``machine`` (default: today, this machine) are the report's."""
    summaries = finished_results(s)
    if not summaries:
        return None
    # A run made before its condition's budget grew trains on; until then it pairs with none of the others. The
    # budget is the one stored with the summaries (check_config), which may be an earlier round's.
    stored = read_json(s.summaries / CONFIG_FILE) or {}
    steps_of = {c: v.get("steps") for c, v in stored.get("conditions", {}).items()}
    budget = {c: steps_of.get(c) or 0 for c in report_conditions(s)}  # no budget recorded: none left out
    results = [r for r in summaries if r.steps >= budget[r.key.condition]]
    waiting = [r for r in summaries if r.steps < budget[r.key.condition]]
    if waiting:
        logging.info(f"{len(waiting)} run(s) trained to fewer steps than their budget, left out of the report")
    if not results:
        return None
    replays = [r for c in report_conditions(s) for r in read_replay_summaries(s.summaries, c)]
    pilots = [
        read_summary(s.summaries / PILOT, RunKey(c, OBSERVING_ARM, s.config.budget_of(c).pilot.seed))
        for c in (s.config.condition, s.config.depth_condition)
    ]
    plots = planned_plots(
        results,
        s.arms,
        s.results_dir / PLOTS,
        sorted({s.thresholds.grad_filter_threshold, *s.thresholds.filter_sweep}),
        replays,
        landscape=[comparison.arm for comparison in s.config.landscape_family],
        landscape_condition=s.config.condition,
        landscape_reference=s.config.family[0].arm,
        depths=(s.config.condition, s.config.depth_condition),
    )
    setup = ReportSetup(
        command=command,
        config=s.config,
        summaries=os.path.relpath(s.summaries, s.results_dir),
        stored=stored,
        thresholds=s.thresholds,
        methods=s.methods,
        # A set without replays (depth, landscape) reports the round's plan for the replays it made.
        planned_replays=(
            s.replay_events
            if any(s.replays_on(c) for c in s.conditions)
            else (s.config.replay_events if replays else 0)
        ),
        date=date or today(),
        machine=machine or machine_summary(),
        reproductions=read_reproductions(s.summaries),
        waiting=tuple(f"{r.key.relpath} ({r.steps} of {budget[r.key.condition]})" for r in waiting),
    )
    provenance = s.results_dir / PROVENANCE
    text = provenance.read_text(encoding="utf-8") if provenance.is_file() else None
    return Report(results, replays, [p for p in pilots if p], setup, plots, text)


def render(s: Settings, report: Report) -> str:
    """The report's Markdown, its plots linked relative to ``<results-dir>`` (not drawn here)."""
    links = {kind: Path(os.path.relpath(path, s.results_dir)).as_posix() for kind, (path, _) in report.plots.items()}
    return render_report(
        report.results,
        report.replays,
        s.arms,
        links,
        report.setup,
        report.pilots,
        OBSERVING_ARM,
        report.provenance,
    )


def held_date_and_machine(report: Path) -> Optional[Tuple[str, str]]:
    """The date and machine a written report states (None without the file or that line)."""
    text = report.read_text(encoding="utf-8") if report.is_file() else ""
    found = re.search(r"^Date: (\S+)\. Machine: (.*)\.$", text, re.M)
    return None if found is None else (found.group(1), found.group(2))


def write_report(
    s: Settings, command: str, date: Optional[str] = None, machine: Optional[str] = None
) -> Optional[Path]:
    """``<results-dir>/README.md`` and its plots in ``<results-dir>/plots/``, from every summary (None when no
    run is at its budget); ``date`` and ``machine`` (default: today, this machine) are the report's."""
    report = gather_report(s, command, date, machine)
    if report is None:
        return None
    for _, draw in report.plots.values():
        draw()
    path = s.results_dir / REPORT
    write_text_atomic(path, render(s, report))
    logging.info(
        f"wrote {path} and {len(report.plots)} plots ({len(report.results)} runs, {len(report.replays)} replays)"
    )
    print(format_table(report.results, s.arms, s.methods))
    return path
