"""The replays, made: each branch of a replay (:mod:`studies.ablation.replay`) trained from the ``none``
run's checkpoint on the same batches (a checkpoint that is gone is made again by retraining the run, checked
step by step), decoded at the window's end and summarised."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.train.tb_tags import TB_TAGS
from studies.ablation.arms import RunKey
from studies.ablation.cpus import (
    first_difference,
)
from studies.ablation.execute import (
    decode_all,
    machine_of,
    run,
    shown,
    train_command,
    train_once,
)
from studies.ablation.replay.events import (
    FILTER,
    FROM_EVENT,
    MATCHED,
    MATCHED_REFERENCE,
    UNIFORM,
    Event,
    Matched,
    ReplayKey,
    choose_replays,
    matched_starts,
)
from studies.ablation.replay.result import (
    Branch,
    ReplayResult,
    collect_branch,
    parameter_layout,
    second_moment_sums,
)
from studies.ablation.runs import (
    EXACT_SCALARS,
    WALL_FILE,
    kept_scalars,
    read_summary,
    write_summary,
)
from studies.ablation.settings import (
    FILTER_ARM,
    OBSERVING_ARM,
    TRAINED_MARKER,
    Settings,
)
from studies.runner import (
    StudyError,
    read_json,
    read_wers,
)
from studies.tb_reader import read_scalars


def start_of(matched: Optional[Matched]) -> Optional[int]:
    return None if matched is None else matched.start


def replay_plan(s: Settings, condition: str, seed: int) -> List[Tuple[ReplayKey, Event, Optional[Matched]]]:
    """The replays of the ``none`` run of ``condition``/``seed`` (which must be finished): up to
    ``replays_per_seed`` events, while the seeds before it (in the plan's order) have left fewer than
    ``replay_events`` in all; each with its matched start."""
    planned = 0
    for earlier in s.plan.all_seeds:
        original = read_summary(s.summaries, RunKey(condition, OBSERVING_ARM, earlier))
        if original is None:
            continue
        room = min(s.replays_per_seed, s.replay_events - planned)
        chosen = choose_replays(original, s.thresholds.grad_filter_threshold, s.args.replay_steps, room)
        if earlier == seed:
            matched = matched_starts(original, chosen, s.args.replay_steps, s.save_every_n, s.config.matched_max_ratio)
            return [(ReplayKey(condition, seed, start), event, m) for (start, event), m in zip(chosen, matched)]
        planned += len(chosen)
    return []


def run_checkpoint(s: Settings, condition: str, seed: int, step: int, commands: List[str]) -> Path:
    """The ``none`` run's ``checkpoint-<step>.pt`` (``step`` a multiple of --save-every-n): its own, or made
    again in ``<none>/seed-<s>-retrained`` (same seed, same weights) when it is gone; then the command that
    retrains it is appended to ``commands`` (once, made now or by an earlier replay), so the list reproduces
    every file it copies."""
    original = RunKey(condition, OBSERVING_ARM, seed)
    path = s.run_dir(original) / f"checkpoint-{step}.pt"
    if path.is_file():
        return path
    redo = s.exp_root / condition / OBSERVING_ARM / f"seed-{seed}-retrained"
    path = redo / f"checkpoint-{step}.pt"
    cmd = train_command(s, original, exp_dir=redo, max_batches=step)
    if not path.is_file():
        run(s, condition, cmd, f"{condition}/none/seed-{seed}: retraining to step {step}", redo)
    check_retrained(s, original, redo, step)  # also when made earlier: a study stopped by a failed check
    if shown(s, condition, cmd) not in commands:
        commands.append(shown(s, condition, cmd))
    return path


def check_retrained(s: Settings, original: RunKey, redo: Path, steps: int) -> None:
    """StudyError unless the run retrained in ``redo`` to step ``steps`` took the original run's path at every
    one of them (:func:`studies.ablation.cpus.first_difference`: batch digest, losses and gradient norm to its
    summary's 7 digits): the same weights, else the branches from its checkpoints start elsewhere."""
    scalars, _ = kept_scalars(read_scalars(redo / "tensorboard"), TB_TAGS, extra=EXACT_SCALARS)
    step = first_difference(read_summary(s.summaries, original), scalars, steps)
    if step is not None:
        raise StudyError(
            f"{original.relpath} retrained in {redo} parts from the run at step {step} of {steps} (batch digest, "
            f"losses and gradient norm to the summary's 7 digits): the retrained weights differ; remove {redo} "
            "and run the study on the CPU model that made the run"
        )


def segment_command(s: Settings, key: ReplayKey, exp_dir: Path, control: str, start: int, end: int) -> List[str]:
    """train.py continuing the ``none`` run of ``key`` in ``exp_dir`` from its ``checkpoint-<start>.pt`` to step
    ``end`` under ``control`` (an arm, or UNIFORM: the filter arm's flags with ``--grad-filter-mode uniform``, the
    library's filter applying its mean factor to every sequence); no checkpoint but the last. (Replays made
    before the library had that mode ran ``python -m studies.ablation.uniform_filter``, as their summaries'
    commands say: the same arithmetic.)"""
    original = RunKey(key.condition, OBSERVING_ARM, key.seed)
    arm = FILTER_ARM if control == UNIFORM else control
    cmd = train_command(
        s, original, exp_dir=exp_dir, arm=arm, max_batches=end, start_batch=start, save_every_n=0, keep_last_k=0
    )
    return [*cmd, "--grad-filter-mode", "uniform"] if control == UNIFORM else cmd


def train_segments(
    s: Settings,
    key: ReplayKey,
    exp_dir: Path,
    checkpoint: Path,
    segments: Sequence[Tuple[str, int]],
    what: str,
    commands: List[str],
) -> None:
    """Copy ``checkpoint`` into ``exp_dir`` and train on from it through ``segments`` (``(control, to step)``
    each, once); the commands are appended to ``commands``."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    start = int(checkpoint.stem.split("-")[1])
    commands.append(
        f"mkdir -p {s.rel(exp_dir, key.condition)} && cp {s.rel(checkpoint, key.condition)} "
        f"{s.rel(exp_dir, key.condition)}/"
    )
    if not (exp_dir / checkpoint.name).is_file() and not (exp_dir / TRAINED_MARKER).is_file():
        shutil.copyfile(checkpoint, exp_dir / checkpoint.name)
    for control, end in segments:
        cmd = segment_command(s, key, exp_dir, control, start, end)
        commands.append(shown(s, key.condition, cmd))
        marker = TRAINED_MARKER if end == segments[-1][1] else f"ablation-trained-{end}.json"
        train_once(s, key.condition, cmd, exp_dir, end, f"{what}: {control} to step {end}", marker)
        start = end


def start_checkpoint(s: Settings, key: ReplayKey, commands: List[str]) -> Path:
    """``checkpoint-<start>.pt`` of the ``none`` run: its own, or made in ``<replay>/prefix`` by training on
    without control from the checkpoint before it."""
    base = run_checkpoint(s, key.condition, key.seed, key.start // s.save_every_n * s.save_every_n, commands)
    if base.name == f"checkpoint-{key.start}.pt":
        return base
    prefix = s.run_dir(key) / "prefix"
    train_segments(s, key, prefix, base, [(OBSERVING_ARM, key.start)], f"{key.relpath}/prefix", commands)
    return prefix / f"checkpoint-{key.start}.pt"


def reference_branch(s: Settings, key: ReplayKey, matched: Matched, commands: List[str]) -> Branch:
    """The run itself over the matched window: its losses and batch digests from its summary, its checkpoint at
    the window's end decoded and its second moments."""
    end = matched.start + s.args.replay_steps
    ref_dir = s.run_dir(key) / MATCHED_REFERENCE
    ref_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = run_checkpoint(s, key.condition, key.seed, end, commands)
    commands.append(
        f"mkdir -p {s.rel(ref_dir, key.condition)} && cp {s.rel(checkpoint, key.condition)} "
        f"{s.rel(ref_dir, key.condition)}/"
    )
    if not (ref_dir / checkpoint.name).is_file():
        shutil.copyfile(checkpoint, ref_dir / checkpoint.name)
    decode_all(s, key.condition, ref_dir, (end, 1, False), f"{key.relpath}/{MATCHED_REFERENCE}: decoding", commands)
    original = read_summary(s.summaries, RunKey(key.condition, OBSERVING_ARM, key.seed))
    window = lambda series: [(st, v) for st, v in series if matched.start < st <= end]  # noqa: E731
    return Branch(
        window(original.objective()),
        window(original.series("batch_digest")),
        read_wers(ref_dir, s.methods, at=(end, 1, False)),
        float("nan"),
        float("nan"),
        second_moment_sums(ref_dir / checkpoint.name),
    )


def matched_branches(s: Settings, key: ReplayKey, matched: Optional[Matched], commands: List[str]) -> Dict[str, Branch]:
    """Branch (d) from the matched start and its reference, the run itself over that window (none without a
    matched start)."""
    if matched is None:
        return {}
    branch_dir = s.run_dir(key) / MATCHED
    start = run_checkpoint(s, key.condition, key.seed, matched.start, commands)
    end = matched.start + s.args.replay_steps
    train_segments(s, key, branch_dir, start, [(FILTER_ARM, end)], f"{key.relpath}/{MATCHED}", commands)
    decode_all(s, key.condition, branch_dir, (end, 1, False), f"{key.relpath}/{MATCHED}: decoding", commands)
    return {
        MATCHED: collect_branch(branch_dir, RunKey(key.condition, MATCHED, key.seed), end, s.methods, TB_TAGS),
        MATCHED_REFERENCE: reference_branch(s, key, matched, commands),
    }


def redo_matched(s: Settings, done: ReplayResult, matched: Optional[Matched]) -> ReplayResult:
    """A finished replay whose matched start is no longer the plan's (chosen by an earlier rule): branch (d)
    and its reference made again from ``matched``, the branches from the event kept as they are; finished as
    :func:`finish_replay`."""
    replay_dir = s.run_dir(done.key)
    for name in (MATCHED, MATCHED_REFERENCE):
        if (replay_dir / name).exists():
            shutil.rmtree(replay_dir / name)
    rel = re.escape(s.rel(replay_dir, done.key.condition))
    made_there = re.compile(rf"{rel}/(?:{re.escape(MATCHED)}|{re.escape(MATCHED_REFERENCE)})(?=[/\s)'\"]|$)")
    commands = [c for c in done.commands if not made_there.search(c)]
    if done.matched is not None and len(commands) == len(done.commands):
        raise StudyError(
            f"{done.key.relpath}: none of its commands made branch (d) in {replay_dir}/{MATCHED}: the summary was "
            f"made with another --exp-root or data folder; rerun the study with the ones that made it"
        )
    branches = {k: v for k, v in done.branches.items() if k not in (MATCHED, MATCHED_REFERENCE)}
    branches.update(matched_branches(s, done.key, matched, commands))
    return finish_replay(s, replace(done, branches=branches, matched=matched, commands=commands))


def run_replay(s: Settings, key: ReplayKey, event: Event, matched: Optional[Matched]) -> ReplayResult:
    """Every branch of one replay (replay.py's module doc), decoded at the window's end; finished as
    :func:`finish_replay`."""
    replay_dir = s.run_dir(key)
    steps = s.args.replay_steps
    end = key.start + steps
    commands: List[str] = []
    checkpoint = start_checkpoint(s, key, commands)
    branches: Dict[str, Branch] = {}
    for name, (first, rest) in FROM_EVENT.items():
        branch_dir = replay_dir / name
        train_segments(
            s, key, branch_dir, checkpoint, [(first, key.start + 1), (rest, end)], f"{key.relpath}/{name}", commands
        )
        decode_all(s, key.condition, branch_dir, (end, 1, False), f"{key.relpath}/{name}: decoding", commands)
        as_run = RunKey(key.condition, name, key.seed)
        branches[name] = collect_branch(branch_dir, as_run, end, s.methods, TB_TAGS, event_step=key.start + 1)
    branches.update(matched_branches(s, key, matched, commands))
    c = s.conditions[key.condition]
    result = ReplayResult(
        key,
        event,
        steps,
        branches,
        parameter_layout([*c.model_flags, *s.model_args]),
        matched,
        machine_of(replay_dir / FILTER),
        commands,
    )
    return finish_replay(s, result)


def folders_wall(root: Path) -> Dict[str, float]:
    """Wall seconds per phase summed over the wall-time files of ``root``'s folders (a replay's branches)."""
    total: Dict[str, float] = {}
    for path in sorted(root.rglob(WALL_FILE)):
        for phase, seconds in (read_json(path) or {}).items():
            total[phase] = total.get(phase, 0.0) + float(seconds)
    return total


def finish_replay(s: Settings, result: ReplayResult) -> ReplayResult:
    """Write ``result``'s summary with its folders' wall time (kept even when its branches saw other batches,
    so the report shows that replay as such), then StudyError if they did (its checkpoints kept to look into),
    else its checkpoints removed."""
    replay_dir = s.run_dir(result.key)
    result = replace(result, wall_s=folders_wall(replay_dir))
    write_summary(s.summaries, result)
    if not result.identical_batches:
        raise StudyError(f"{result.key.relpath}: the branches saw other batches than the run (see {replay_dir})")
    for path in replay_dir.rglob("*.pt"):
        path.unlink()
    return result
