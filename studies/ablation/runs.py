"""One finished run of the ablation: what it measured, read from its folder (TensorBoard scalars,
wer-summary files, wall time) and kept as a summary in the study's folder (:mod:`studies.ablation.compact`: a
small JSON and its per-step series), so that the report outlives the run folders.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from icefall_lite.train.tb_tags import TrainingScalarTags
from icefall_lite.utils import write_text_atomic
from studies.ablation.arm_names import canonical_arm, stored_names
from studies.ablation.compact import read_run_summary, write_run_summary
from studies.ablation.cpus import computes_as
from studies.ablation.pairing import cpu_name
from studies.ablation.records import (  # noqa: F401  (the names the study's modules read from here)
    ERROR_CLIP,
    EXACT_SCALARS,
    KEPT_FILTER_STATS,
    KEPT_SCALARS,
    OBJECTIVE_SIMPLE_SCALE,
    RECURRENT_CLIP,
    RunKey,
    RunResult,
)
from studies.runner import StudyError, read_json, write_json_atomic
from studies.tb_reader import Series

# Every round's run summaries, one folder per round. family.json (fixed before its round's runs, never edited)
# names its round's folder as the recipe folder they were made in; they live here now.
SUMMARIES_DIR = Path(__file__).resolve().parent / "summaries"
ROUND_DIRS = {"ablation-runs": "round-1", "ablation-runs-2": "round-2"}

WALL_FILE = "ablation-wall.json"  # in every run dir: wall seconds per phase, kept across reruns
# In every run dir: per phase, the segments started and ended and the CPU seconds of those that ended.
CPU_FILE = "ablation-cpu.json"


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


# --------------------------------------------------------------------------
# Summaries in the study's folder
# --------------------------------------------------------------------------


def round_summaries(recorded: str) -> Path:
    """The folder of a round's run summaries, from the name family.json records for it (``ablation-runs-2`` ->
    ``studies/ablation/summaries/round-2``); a name with no round is taken as a folder in :data:`SUMMARIES_DIR`."""
    return SUMMARIES_DIR / ROUND_DIRS.get(recorded, recorded)


def summary_path(summaries_dir: Path, key) -> Path:
    """Where the summary of a run or a replay (``key``: a RunKey or a ReplayKey) is kept:
    ``<summaries_dir>/<key.relpath>.json``."""
    return summaries_dir / f"{key.relpath}.json"


_RUN_SUMMARY = re.compile(r"seed-(\d+)\.json")


def stored_runs(summaries_dir: Path, condition: str, arm: str = "*") -> List[RunKey]:
    """The runs of ``condition`` (of one ``arm``, or of every arm: ``*``) with a summary kept, by arm then seed,
    arms by their names now (a folder of an old name counts as its arm's, :mod:`studies.ablation.arm_names`); a
    replay's summary (``replays/seed-<seed>-from-<step>.json``) is not a run's."""
    keys = {
        RunKey(condition, canonical_arm(path.parent.name), int(match.group(1)))
        for path in summaries_dir.glob(f"{condition}/*/seed-*.json")
        if (match := _RUN_SUMMARY.fullmatch(path.name))
    }
    return sorted((k for k in keys if arm in ("*", k.arm)), key=lambda k: (k.arm, k.seed))


def write_summary(summaries_dir: Path, result) -> Path:
    """The summary of a run (a RunResult: a small JSON and its series file, :mod:`studies.ablation.compact`) or
    of a replay (a ReplayResult: ``key`` and ``to_json()``, one JSON)."""
    path = summary_path(summaries_dir, result.key)
    if isinstance(result, RunResult):
        return write_run_summary(path, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result.to_json(), separators=(",", ":")) + "\n")
    return path


def read_summary(summaries_dir: Path, key: RunKey) -> Optional[RunResult]:
    """The run's summary (either form, :func:`studies.ablation.compact.read_run_summary`; in its arm's folder or
    in the folder of the arm's old name), or None when it has none yet; with the CPU its CPU computes as, where
    ``<summaries_dir>/cpus.json`` records a reproduction."""
    names = stored_names(canonical_arm(key.arm))
    stored = [summary_path(summaries_dir, RunKey(key.condition, name, key.seed)) for name in names]
    path = next((p for p in stored if p.is_file()), None)
    if path is None:
        return None
    result = read_run_summary(path)
    joined = computes_as(summaries_dir, key.condition, result.machine.get("torch", ""))
    result.computes_as = joined.get(cpu_name(result.machine) or "")
    return result


def load_summaries(folder: Path) -> List[RunResult]:
    """Every run summary (``seed-<n>.json``, either form; not a replay's) anywhere under ``folder``, by path;
    without the CPUs they compute as (:func:`read_summary` adds those for one round's folder)."""
    paths = sorted(p for p in folder.rglob("seed-*.json") if _RUN_SUMMARY.fullmatch(p.name))
    return [read_run_summary(p) for p in paths]


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
