"""The replays in the report: each control's differences from its reference, averaged per seed first, and
the tables of events, controls and second moments."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from studies.ablation.markdown import markdown_table
from studies.ablation.replay.events import (
    CONTROLS,
    EARLY_STEPS,
    EVENT_ONLY,
    FILTER,
    LABELS,
    MATCHED,
    MATCHED_REFERENCE,
    NO_CONTROL,
    UNIFORM,
)
from studies.ablation.replay.result import Branch, ReplayResult, layer_ratios, reproduces, reproduction
from studies.ablation.runs import RunResult
from studies.stats.paired import PairedDifference, paired_difference


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
