"""One finished run of the ablation: what it measured, read from its folder (TensorBoard scalars,
wer-summary files, wall time) and kept as a small JSON summary beside RESULTS.md, so that the report
outlives the run folders.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from icefall_lite.train.tb_tags import TrainingScalarTags
from icefall_lite.utils import write_text_atomic
from studies.ablation.arms import RunKey
from studies.ablation.cpus import computes_as
from studies.ablation.pairing import cpu_name
from studies.runner import StudyError, read_json, write_json_atomic
from studies.tb_reader import Series, seven_digits

WALL_FILE = "ablation-wall.json"  # in every run dir: wall seconds per phase, kept across reruns
# In every run dir: per phase, the segments started and ended and the CPU seconds of those that ended.
CPU_FILE = "ablation-cpu.json"
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


def add_wall_time(run_dir: Path, phase: str, seconds: float) -> Dict[str, float]:
    """Add ``seconds`` to ``phase`` in the run's wall-time file (kept across reruns)."""
    wall = read_json(run_dir / WALL_FILE) or {}
    wall[phase] = wall.get(phase, 0.0) + seconds
    write_json_atomic(run_dir / WALL_FILE, wall)
    return wall


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that have ended (with those of their own children
    they waited for). The OS adds a child's CPU time here when it is waited for, not while it runs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_segment(run_dir: Path, phase: str, ended_s: Optional[float] = None) -> None:
    """Count a segment of ``phase`` as started (``ended_s`` None) or as ended with ``ended_s`` CPU seconds.
    A phase that already has wall time but no CPU record ran before CPU time was recorded: that earlier
    time counts as a segment started and never ended, so the phase's CPU time stays incomplete. A write
    that fails is logged, not raised: the run matters more than its bookkeeping, and a segment whose end
    is not written is counted as cut off."""
    try:
        cpu = read_json(run_dir / CPU_FILE) or {}
        if phase not in cpu:
            earlier = (read_json(run_dir / WALL_FILE) or {}).get(phase, 0.0) > 0
            cpu[phase] = {"started": int(earlier), "ended": 0, "s": 0.0}
        if ended_s is None:
            cpu[phase]["started"] += 1
        else:
            cpu[phase]["ended"] += 1
            cpu[phase]["s"] += ended_s
        write_json_atomic(run_dir / CPU_FILE, cpu)
    except OSError as e:
        logging.warning(f"CPU time of {run_dir} ({phase}) not written ({e}); its CPU time counts as incomplete")


def cpu_time_recorded(run_dir: Path) -> Dict[str, float]:
    """``{phase: CPU seconds}`` of the phases whose every segment ran to its end; a phase with a segment cut
    off (the study killed while it ran: its CPU time is never counted) or made before CPU time was recorded
    is left out."""
    cpu = read_json(run_dir / CPU_FILE) or {}
    return {phase: v["s"] for phase, v in cpu.items() if v["started"] == v["ended"]}


@contextlib.contextmanager
def wall_time_kept(run_dir: Path, phase: str, every_s: float = 60.0) -> Iterator[None]:
    """Add the wall time spent in the block to ``phase`` of the run's wall-time file, every ``every_s``
    seconds while it runs and the rest when it ends: a study killed mid-run (a session's hard end, which
    runs no ``finally``) loses at most ``every_s`` seconds of it, not the whole segment. A write that fails
    while the block runs is logged and its time added at the next.

    The CPU time of the child processes the block ran and waited for (the study runs one at a time) goes to
    the run's CPU file (``run_dir`` is made if needed) when the block ends normally or with a StudyError (the
    failed command was waited for). Any other exit leaves its segment started and not ended: a killed study
    runs no ``finally``, and on Ctrl-C ``subprocess.run`` kills its child without waiting for it, so the
    child's CPU time is not yet counted."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _cpu_segment(run_dir, phase)
    cpu_before = children_cpu_s()
    last = time.monotonic()
    stop = threading.Event()
    lock = threading.Lock()

    def flush() -> None:
        nonlocal last
        with lock:
            now = time.monotonic()
            add_wall_time(run_dir, phase, now - last)
            last = now

    def tick() -> None:
        while not stop.wait(every_s):
            try:
                flush()
            except OSError as e:
                logging.warning(f"wall time of {run_dir} not written ({e}); retried in {every_s:.0f} s")

    ticker = threading.Thread(target=tick, name=f"wall-time {phase}", daemon=True)
    ticker.start()
    waited = False
    try:
        yield
        waited = True
    except StudyError:
        waited = True
        raise
    finally:
        stop.set()
        ticker.join()
        flush()
        if waited:
            _cpu_segment(run_dir, phase, ended_s=children_cpu_s() - cpu_before)


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
    (:func:`cpu_time_recorded`; empty in older summaries); ``computes_as``: the name of the CPUs
    ``machine``'s CPU was shown to compute as (:mod:`studies.ablation.cpus`; set when the summary is read, not
    stored in it), else None.
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
        (:func:`cpu_time_recorded`); else None."""
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
        return {
            "key": {"condition": self.key.condition, "arm": self.key.arm, "seed": self.key.seed},
            "wer": [[m, t, v] for (m, t), v in self.wer.items()],
            "wer_at": [[step, m, t, v] for step, wers in sorted(self.wer_at.items()) for (m, t), v in wers.items()],
            "decoding": self.decoding,
            "scalars": {k: _exact(v) if k in EXACT_SCALARS else _rounded(v) for k, v in self.scalars.items()},
            "filters": [[layer, stat, _rounded(v)] for (layer, stat), v in self.filters.items()],
            "wall_s": self.wall_s,
            "warm_end": self.warm_end,
            "machine": self.machine,
            "commands": self.commands,
            "cpu_s": self.cpu_s,
        }

    @staticmethod
    def from_json(data: Dict) -> "RunResult":
        wer_at: Dict[int, Dict[Tuple[str, str], float]] = {}
        for step, m, t, v in data.get("wer_at", []):
            wer_at.setdefault(int(step), {})[(m, t)] = v
        return RunResult(
            RunKey(**data["key"]),
            {(m, t): v for m, t, v in data["wer"]},
            {k: [(int(s), float(v)) for s, v in series] for k, series in data["scalars"].items()},
            {(int(layer), stat): [(int(s), float(v)) for s, v in series] for layer, stat, series in data["filters"]},
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


# --------------------------------------------------------------------------
# Summaries beside RESULTS.md
# --------------------------------------------------------------------------


def summary_path(summaries_dir: Path, key) -> Path:
    """Where the summary of a run or a replay (``key``: a RunKey or a ReplayKey) is kept:
    ``<summaries_dir>/<key.relpath>.json``."""
    return summaries_dir / f"{key.relpath}.json"


_RUN_SUMMARY = re.compile(r"seed-(\d+)\.json")


def stored_runs(summaries_dir: Path, condition: str, arm: str = "*") -> List[RunKey]:
    """The runs of ``condition`` (of one ``arm``, or of every arm) with a summary kept, by arm then seed; a
    replay's summary (``replays/seed-<seed>-from-<step>.json``) is not a run's."""
    keys = [
        RunKey(condition, path.parent.name, int(match.group(1)))
        for path in summaries_dir.glob(f"{condition}/{arm}/seed-*.json")
        if (match := _RUN_SUMMARY.fullmatch(path.name))
    ]
    return sorted(keys, key=lambda k: (k.arm, k.seed))


def write_summary(summaries_dir: Path, result) -> Path:
    """The summary of a run or a replay (a RunResult or a ReplayResult: ``key`` and ``to_json()``)."""
    path = summary_path(summaries_dir, result.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    return path


def read_summary(summaries_dir: Path, key: RunKey) -> Optional[RunResult]:
    """The run's summary, or None when it has none yet; with the CPU its CPU computes as, where
    ``<summaries_dir>/cpus.json`` records a reproduction."""
    data = read_json(summary_path(summaries_dir, key))
    if data is None:
        return None
    result = RunResult.from_json(data)
    joined = computes_as(summaries_dir, key.condition, result.machine.get("torch", ""))
    result.computes_as = joined.get(cpu_name(result.machine) or "")
    return result


# --------------------------------------------------------------------------
# A finished run's folder
# --------------------------------------------------------------------------


def kept_scalars(
    scalars: Dict[str, Series], tags: TrainingScalarTags, extra: Sequence[str] = ()
) -> Tuple[Dict[str, Series], Dict[Tuple[int, str], Series]]:
    """The scalars a summary keeps (and ``extra`` ones), by TrainingScalarTags field, and the per-layer
    filter statistics."""
    names = (*KEPT_SCALARS, *extra)
    wanted = {name: scalars[getattr(tags, name)] for name in names if getattr(tags, name) in scalars}
    filters = {}
    for tag, series in scalars.items():
        layer_stat = tags.parse_filter_tag(tag)
        if layer_stat is not None and layer_stat[1] in KEPT_FILTER_STATS:
            filters[layer_stat] = series
    for name in (RECURRENT_CLIP, ERROR_CLIP):
        largest = largest_over_layers(scalars, getattr(tags, name))
        if largest:
            wanted[name] = largest
    return wanted, filters


def largest_over_layers(scalars: Dict[str, Series], layer_tag: str) -> Series:
    """``[(step, the largest value over layers)]`` of the scalars tagged ``layer_tag`` (a format with
    ``{layer}``); empty when there are none."""
    prefix, suffix = layer_tag.split("{layer}")
    by_step: Dict[int, float] = {}
    for tag, series in scalars.items():
        if tag.startswith(prefix) and tag.endswith(suffix) and tag[len(prefix) : -len(suffix)].isdigit():
            for step, v in series:
                by_step[step] = max(by_step.get(step, v), v)
    return sorted(by_step.items())
