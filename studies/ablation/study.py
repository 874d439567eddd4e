"""The ablation's runs, made: every run of the plan trained and decoded at its condition's decoding points
(resumable), the replayed outlier events with their controls, the pilot that checks the budget, the
checkpoints pruned as each run is done, and the report rewritten after each from every summary.

The recipe's entry point (``lstm_transducer_stateless/ablation.py``) turns its flags into
:class:`Settings` and calls :func:`run_plan`, :func:`run_pilot` and :func:`write_report`; the commands, the
files that say a step is finished and the layout of the runs are here.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.tb_tags import TB_TAGS
from studies.ablation.arms import CONDITIONS, Arm, Condition, Plan, RunKey, Thresholds, same_controls
from studies.ablation.cpus import (
    CPUS_FILE,
    Reproduction,
    computes_as,
    first_difference,
    read_reproductions,
    write_reproduction,
)
from studies.ablation.family import StudyConfig
from studies.ablation.metrics import format_table
from studies.ablation.pairing import cpu_name, cpu_of
from studies.ablation.plots import write_plots
from studies.ablation.replay import (
    FILTER,
    FROM_EVENT,
    MATCHED,
    MATCHED_REFERENCE,
    UNIFORM,
    Branch,
    Event,
    Matched,
    ReplayKey,
    ReplayResult,
    choose_replays,
    collect_branch,
    matched_starts,
    parameter_layout,
    read_replay_summaries,
    read_replay_summary,
    second_moment_sums,
)
from studies.ablation.runs import (
    EXACT_SCALARS,
    WALL_FILE,
    RunResult,
    cpu_time_recorded,
    kept_scalars,
    read_summary,
    stored_runs,
    wall_time_kept,
    write_summary,
)
from studies.ablation.section import SECTION, ReportSetup, render_section
from studies.runner import (
    Progress,
    StudyError,
    decode_flags,
    decoded,
    machine_record,
    machine_summary,
    read_json,
    read_wers,
    run_command,
    today,
    write_json_atomic,
)
from studies.tb_reader import read_scalars

CONFIG_FILE = "ablation-config.json"
ARM_FILE = "ablation-arm.json"  # in every run dir: the arm's train.py flags
TRAINED_MARKER = "ablation-trained.json"  # in every run dir once train.py has finished (validation included)
MACHINE_FILE = "ablation-machine.json"  # in every run dir: the machine of every train.py invocation
OBSERVING_ARM = "none"
FILTER_ARM = "filter"
PILOT = "pilot"  # <exp-root>/pilot/..., <summaries>/pilot/...
VERIFY_DIR = "verify-cpu"  # <exp-root>/verify-cpu/...: retrainings of another CPU's runs, removed when checked


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclass
class Settings:
    """Resolved flags: the round's configuration, the conditions (with any budget override), their data folders
    and BPE models, the arms, the plan, the replays, the paths (``recipe_dir``: where the recipe's scripts are;
    ``summaries``: the run summaries of the round)."""

    args: argparse.Namespace
    config: StudyConfig
    recipe_dir: Path
    conditions: Dict[str, Condition]
    work_dirs: Dict[str, Path]
    bpe_models: Dict[str, Path]
    exp_root: Path
    results_dir: Path
    summaries: Path
    thresholds: Thresholds
    arms: Dict[str, Arm]
    plan: Plan
    replay_events: int
    replays_per_seed: int
    model_args: List[str]

    @property
    def methods(self) -> List[str]:
        return list(dict.fromkeys(self.args.decoding_methods))

    @property
    def save_every_n(self) -> int:
        return self.args.save_every_n

    @property
    def avg(self) -> int:
        return self.args.avg

    def decode_points(self, steps: int) -> List[int]:
        """Where a run of ``steps`` is decoded: a third, two thirds and the whole budget, each rounded to a
        checkpoint step; a point with fewer than ``avg`` checkpoints before it (icefall's averaging needs
        them) is dropped, the budget itself kept. The points are multiples of the average period as well,
        so that icefall's average between two checkpoints is exact (ablation.py checks the budget and
        ``avg x save_every_n``)."""
        unit = math.lcm(self.save_every_n, self.args.average_period)
        points = []
        for k in (1, 2, 3):
            point = round(steps * k / 3 / unit) * unit if k < 3 else steps
            if point == steps or point >= (self.avg + 1) * self.save_every_n:
                points.append(point)
        return sorted(set(points))

    def points_of(self, condition: str, steps: Optional[int] = None) -> List[int]:
        """Where a run of ``condition`` trained to ``steps`` (default: its budget) is decoded: its family.json
        budget's points at that budget, else (a budget set by ``--steps``) :meth:`decode_points`."""
        budget = self.config.budget_of(condition)
        steps = self.conditions[condition].steps if steps is None else steps
        return list(budget.decode_at) if steps == budget.steps else self.decode_points(steps)

    def decoding_of(self, point: int) -> Tuple[int, int, bool]:
        """``(iteration, avg, use_averaged_model)`` of the decoding at ``point``: icefall's averaged model over
        the ``avg`` checkpoints before it when there are that many, else the checkpoint alone."""
        if point >= (self.avg + 1) * self.save_every_n:
            return point, self.avg, True
        return point, 1, False

    def rel(self, path: Path, condition: str) -> str:
        """``path`` relative to the condition's data folder (where the commands run)."""
        return os.path.relpath(path.resolve(), self.work_dirs[condition])

    def run_dir(self, key: RunKey) -> Path:
        return self.exp_root / key.relpath

    def replay_dir(self, key: ReplayKey) -> Path:
        return self.exp_root / key.relpath

    def replays_on(self, condition: str) -> bool:
        return self.replay_events > 0 and {OBSERVING_ARM, FILTER_ARM} <= {a.name for a in self.plan.arms}

    def stored_config(self) -> Dict:
        """What must not change between reruns into the same results."""
        return {
            "round": self.config.round,
            "conditions": {
                name: {
                    "steps": c.steps,
                    "max_duration": c.max_duration,
                    "flags": c.all_train_flags(),
                    "bpe_model": self.rel(self.bpe_models[name], name),
                }
                for name, c in self.conditions.items()
            },
            "model_args": self.model_args,
            "replay_steps": self.args.replay_steps,
            "save_every_n": self.save_every_n,
            "avg": self.avg,
            "average_period": self.args.average_period,
        }


def find_bpe_model(work_dir: Path) -> Path:
    """The single ``data/lang_bpe_*/bpe.model`` under ``work_dir``."""
    found = sorted((work_dir / "data").glob("lang_bpe_*/bpe.model"))
    if len(found) != 1:
        what = ", ".join(str(p) for p in found) if found else "none"
        raise StudyError(f"expected one data/lang_bpe_*/bpe.model in {work_dir} (found: {what})")
    return found[0]


def stored_bpe_model(summaries: Path, condition: str, work_dir: Path) -> Path:
    """The BPE model the condition's summaries were made with (their stored settings), in ``work_dir``."""
    stored = read_json(summaries / CONFIG_FILE) or {}
    relpath = stored.get("conditions", {}).get(condition, {}).get("bpe_model")
    if relpath is None:
        raise StudyError(f"{summaries / CONFIG_FILE} has no BPE model for condition {condition}")
    return work_dir / relpath


def pairs_here(s: Settings, result: RunResult) -> bool:
    """Whether ``result`` counts as made on this CPU (its own, or one this CPU was shown to compute as, for
    its condition and this torch), or does not record its CPU."""
    machine = machine_record()
    here = cpu_name(machine)
    here_as = computes_as(s.summaries, result.key.condition, machine["torch"]).get(here, here)
    return cpu_of(result) in (None, here_as)


def runs_on_other_cpus(s: Settings, key: RunKey) -> List[str]:
    """The runs of ``key``'s condition and seed, in any arm, made on another CPU than this one (model, flags
    digest or threads) that this one has not been shown to compute as (:func:`verify_cpu`). Runs on two CPUs
    round differently and pair with none of each other's, so a run of ``key`` made here would count for
    nothing in their comparisons (its seed's runs are paired only with each other)."""
    found = []
    for made in stored_runs(s.summaries, key.condition):
        other = read_summary(s.summaries, made) if made.seed == key.seed else None
        if other is not None and not pairs_here(s, other):
            found.append(f"{made.arm} / seed-{key.seed} ({cpu_name(other.machine)})")
    return found


def verify_cpu(s: Settings, steps: int) -> List[Reproduction]:
    """Retrain from scratch, on this CPU, the newest seed of every arm each other CPU made on each condition
    with this torch, ``steps`` steps each, and compare every step with its summary
    (:mod:`studies.ablation.cpus`); record the outcome per other CPU in ``<summaries>/cpus.json`` and return
    it. Runs made with another torch are not checked (logged with their count). The retrainings are removed
    afterwards."""
    machine = machine_record()
    here = cpu_name(machine)
    newest: Dict[str, Dict[Tuple[str, str], RunResult]] = {}
    other_torch = 0
    for result in finished_results(s):
        name = cpu_name(result.machine)
        if name is None or name == here:
            continue
        if result.machine.get("torch") != machine["torch"]:
            other_torch += 1
            continue
        newest.setdefault(name, {})[(result.key.condition, result.key.arm)] = result  # seeds ascend
    if other_torch:
        logging.warning(f"{other_torch} run(s) made with another torch than this one ({machine['torch']}): not checked")
    if not newest:
        raise StudyError(
            f"no run in {s.summaries} was made on another CPU with torch {machine['torch']}: nothing to verify"
        )
    out = []
    for other, runs in sorted(newest.items()):
        outcome: Dict[str, Optional[int]] = {}
        commands: List[str] = []
        for original in runs.values():
            exp_dir = s.exp_root / VERIFY_DIR / original.key.relpath
            shutil.rmtree(exp_dir, ignore_errors=True)  # from scratch: a checkpoint left would be resumed
            cmd = train_command(s, original.key, exp_dir=exp_dir, max_batches=steps, save_every_n=0)
            commands.append(shown(s, original.key.condition, cmd))
            run(s, original.key.condition, cmd, f"{original.key.relpath}: retraining {steps} steps", exp_dir)
            scalars, _ = kept_scalars(read_scalars(exp_dir / "tensorboard"), TB_TAGS, extra=EXACT_SCALARS)
            step = outcome[original.key.relpath] = first_difference(original, scalars, steps)
            logging.info(
                f"{original.key.relpath} (made on {other}): "
                + (f"every one of {steps} steps reproduced" if step is None else f"parts at step {step}")
            )
        reproduction = Reproduction(here, other, steps, outcome, today(), commands, machine["torch"])
        write_reproduction(s.summaries, reproduction)
        shutil.rmtree(s.exp_root / VERIFY_DIR, ignore_errors=True)
        logging.info(
            f"{here} {'reproduced' if reproduction.reproduced else 'did not reproduce'} {other}'s runs "
            f"({len(outcome)} runs, {steps} steps each): recorded in {s.summaries / CPUS_FILE}"
        )
        out.append(reproduction)
    return out


def _grew(s: Settings, condition: str, old: Dict, new: Dict) -> bool:
    """Whether ``condition``'s stored settings ``old`` differ from ``new`` only by a longer budget whose
    decoding points begin with those of every run made before (they keep only their last checkpoints, so an
    earlier point they were not decoded at could not be decoded now)."""
    if not old["steps"] < new["steps"] or {**old, "steps": new["steps"]} != new:
        return False
    points = s.points_of(condition)
    for key in stored_runs(s.summaries, condition):
        made = read_summary(s.summaries, key)
        before = sorted(made.wer_at or [made.steps]) if made is not None else []
        if points[: len(before)] != before:
            return False
    return True


def check_config(s: Settings) -> None:
    """Store the settings on the first run; refuse a rerun with other settings for a condition already run
    (but a budget that grew and keeps the earlier decoding points: its finished runs train on from their last
    checkpoint), or with an arm whose controls differ from those its existing runs were trained with."""
    path = s.summaries / CONFIG_FILE
    wanted = s.stored_config()
    stored = read_json(path)
    if stored is not None:
        changed = {k: (stored.get(k), v) for k, v in wanted.items() if k != "conditions" and stored.get(k) != v}
        for name, c in wanted["conditions"].items():
            old = stored.get("conditions", {}).get(name)
            if old is not None and _grew(s, name, old, c):
                logging.info(f"condition {name}: the budget grew from {old['steps']} to {c['steps']} steps")
            elif old is not None and old != c:
                changed[f"condition {name}"] = (old, c)
        if changed:
            detail = "; ".join(f"{k}: was {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise StudyError(
                f"{s.summaries} was made with other settings ({detail}); use another --summaries or "
                "--results-dir, or remove it to start over"
            )
        wanted["conditions"] = {**stored.get("conditions", {}), **wanted["conditions"]}
    s.summaries.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, wanted)
    for name, arm in s.arms.items():
        for arm_file in sorted(s.exp_root.glob(f"*/{name}/seed-*/{ARM_FILE}")):
            trained = read_json(arm_file)["train_flags"]
            if not same_controls(trained, arm.train_flags()):
                raise StudyError(
                    f"{arm_file.parent} was trained with {shlex.join(trained)}, but arm {name} is now "
                    f"{shlex.join(arm.train_flags())}; give the arm's threshold it was run with, "
                    "or use another --exp-root"
                )


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def script(s: Settings, condition: str, name: str) -> str:
    """A recipe script's path from the condition's data folder."""
    return os.path.relpath(s.recipe_dir / name, s.work_dirs[condition])


def train_command(
    s: Settings,
    key: RunKey,
    exp_dir: Optional[Path] = None,
    arm: Optional[str] = None,
    steps: Optional[int] = None,
    **overrides: int,
) -> List[str]:
    """train.py for run ``key`` (or, with ``exp_dir``/``arm``/``overrides``, a replay branch or a retraining);
    ``steps``: the budget (default: the condition's); ``overrides`` may set ``max_batches``, ``start_batch``,
    ``keep_last_k``, ``save_every_n``. A run keeps every checkpoint while it trains (``--keep-last-k 0``):
    the averaged decodings and the replays need them; :func:`prune_run` removes them afterwards."""
    a = s.args
    c = s.conditions[key.condition]
    start = ["--start-batch", str(overrides["start_batch"])] if "start_batch" in overrides else []
    return (
        [
            "python",
            script(s, key.condition, "lstm_transducer_stateless/train.py"),
            "--exp-dir",
            s.rel(exp_dir or s.run_dir(key), key.condition),
            "--bpe-model",
            s.rel(s.bpe_models[key.condition], key.condition),
            "--num-epochs",
            "100",
            "--max-batches",
            str(overrides.get("max_batches", steps or c.steps)),
            *start,
            "--seed",
            str(key.seed),
            "--max-duration",
            f"{c.max_duration:g}",
            "--num-workers",
            str(a.num_workers),
            "--save-every-n",
            str(overrides.get("save_every_n", s.save_every_n)),
            "--keep-last-k",
            str(overrides.get("keep_last_k", 0)),
            "--average-period",
            str(a.average_period),
        ]
        + s.arms[arm or key.arm].train_flags()
        + c.all_train_flags()
        + s.model_args
    )


def decode_command(s: Settings, condition: str, run_dir: Path, method: str, at: Tuple[int, int, bool]) -> List[str]:
    """decode.py for the weights of ``at = (iteration, avg, use_averaged_model)``."""
    return (
        [
            "python",
            script(s, condition, "lstm_transducer_stateless/decode.py"),
            "--exp-dir",
            s.rel(run_dir, condition),
            "--bpe-model",
            s.rel(s.bpe_models[condition], condition),
            *decode_flags(at[0], method, at[1], at[2]),
            "--num-workers",
            str(s.args.num_workers),
        ]
        + list(s.conditions[condition].model_flags)
        + s.model_args
    )


def shown(s: Settings, condition: str, cmd: List[str]) -> str:
    """A command as typed from the recipe folder."""
    where = os.path.relpath(s.work_dirs[condition], s.recipe_dir)
    return shlex.join(cmd) if where == "." else f"(cd {shlex.quote(where)} && {shlex.join(cmd)})"


def run(s: Settings, condition: str, cmd: List[str], what: str, log_hint: Path) -> float:
    """Run ``cmd`` in the condition's data folder with this Python; returns its wall time."""
    return run_command(cmd, s.work_dirs[condition], what, shown=shown(s, condition, cmd), log_hint=log_hint)


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------


def run_done(s: Settings, key: RunKey, summaries: Optional[Path] = None, steps: Optional[int] = None) -> bool:
    """Whether ``key`` has a summary decoded with every method on every test set, trained to ``steps`` at least
    (default: its condition's budget; a run made before the budget grew is not done: it trains on)."""
    result = read_summary(summaries or s.summaries, key)
    if steps is None:
        steps = s.conditions[key.condition].steps
    return (
        result is not None and result.steps >= steps and all((m, t) in result.wer for m in s.methods for t in TEST_SETS)
    )


def decode_all(
    s: Settings, condition: str, run_dir: Path, at: Tuple[int, int, bool], what: str, commands: List[str]
) -> None:
    """Decode ``run_dir`` at ``at`` with every method (those decoded before are skipped); the commands are
    appended to ``commands``."""
    for method in s.methods:
        cmd = decode_command(s, condition, run_dir, method, at)
        commands.append(shown(s, condition, cmd))
        if decoded(run_dir, method, at=at):
            continue
        with wall_time_kept(run_dir, f"decode/{method}"):
            run(s, condition, cmd, what, run_dir)


def train_once(
    s: Settings, condition: str, cmd: List[str], exp_dir: Path, steps: int, what: str, marker: str = TRAINED_MARKER
) -> bool:
    """Run the train.py command ``cmd`` into ``exp_dir`` unless it finished there before (its marker file)
    to ``steps`` or more; its wall time is added to the folder's, its machine (CPU model, torch) to the folder's
    list. Returns whether it ran."""
    finished = read_json(exp_dir / marker)
    if finished is not None and finished.get("steps", 0) >= steps:
        return False  # a marker of fewer steps (the budget grew): train.py resumes from its newest checkpoint
    exp_dir.mkdir(parents=True, exist_ok=True)
    machines = (read_json(exp_dir / MACHINE_FILE) or {}).get("train", [])
    write_json_atomic(exp_dir / MACHINE_FILE, {"train": machines + [machine_record()]})
    with wall_time_kept(exp_dir, "train"):
        run(s, condition, cmd, what, exp_dir / "log")
    write_json_atomic(exp_dir / marker, {"steps": steps})
    return True


def machine_of(exp_dir: Path) -> Dict[str, str]:
    """The machine a folder was trained on: its one CPU model and torch version, or (trained in parts on
    several) ``mixed: ...`` of each, which pairs with no other run; empty when not recorded."""
    machines = (read_json(exp_dir / MACHINE_FILE) or {}).get("train", [])
    if not machines:
        return {}
    out = {}
    for field_name in ("cpu_model", "cpu_flags", "threads", "torch"):
        if not any(field_name in m for m in machines):  # recorded before the field existed
            continue
        seen = list(dict.fromkeys(m.get(field_name, "unknown") for m in machines))
        out[field_name] = seen[0] if len(seen) == 1 else "mixed: " + " + ".join(seen)
    return out


def collect_run(
    s: Settings, key: RunKey, run_dir: Path, steps: int, points: Sequence[int], commands: List[str]
) -> RunResult:
    """Read a finished run: WERs at every decoding point, the scalars kept (with the per-layer filter stats
    and the batch digests), wall time, machine, commands."""
    c = s.conditions[key.condition]
    wanted, filters = kept_scalars(read_scalars(run_dir / "tensorboard"), TB_TAGS, extra=("batch_digest",))
    wer_at = {p: read_wers(run_dir, s.methods, at=s.decoding_of(p)) for p in points}
    last = s.decoding_of(steps)
    return RunResult(
        key,
        wer_at[steps],
        wanted,
        filters,
        read_json(run_dir / WALL_FILE) or {},
        c.warm_end,
        machine_of(run_dir),
        wer_at,
        {"avg": last[1], "use_averaged_model": last[2], "save_every_n": s.save_every_n},
        commands,
        cpu_time_recorded(run_dir),
    )


def kept_checkpoints(s: Settings, steps: int) -> List[int]:
    """The checkpoint steps a finished run keeps: those of its decoding at the whole budget (to decode it
    again, with another method say)."""
    iteration, avg, averaged = s.decoding_of(steps)
    return [iteration - avg * s.save_every_n, iteration] if averaged else [iteration]


def prune_run(run_dir: Path, keep: Sequence[int]) -> int:
    """Delete the run's checkpoints (``checkpoint-*.pt``, ``epoch-*.pt``, ``best-*.pt``, about 96 MB each for
    the default model) but ``checkpoint-<k>.pt`` for ``k`` in ``keep``; returns how many."""
    removed = 0
    for path in [*run_dir.glob("checkpoint-*.pt"), *run_dir.glob("epoch-*.pt"), *run_dir.glob("best-*.pt")]:
        if path.name not in {f"checkpoint-{k}.pt" for k in keep}:
            path.unlink()
            removed += 1
    return removed


def train_and_decode(
    s: Settings, key: RunKey, run_dir: Path, steps: int, points: Sequence[int], summaries: Path
) -> RunResult:
    """Train (or resume) ``key`` into ``run_dir`` to ``steps``, decode it at ``points``, write its summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / ARM_FILE, {"arm": key.arm, "train_flags": s.arms[key.arm].train_flags()})
    cmd = train_command(s, key, exp_dir=run_dir, steps=steps)
    commands = [shown(s, key.condition, cmd)]
    if not train_once(s, key.condition, cmd, run_dir, steps, f"{key.relpath}: training"):
        logging.info(f"{key.relpath}: training finished earlier")
    for point in points:
        decode_all(s, key.condition, run_dir, s.decoding_of(point), f"{key.relpath}: decoding at {point}", commands)
    result = collect_run(s, key, run_dir, steps, points, commands)
    write_summary(summaries, result)
    return result


def run_one(s: Settings, key: RunKey) -> RunResult:
    """Train and decode one run at its decoding points; write its summary; prune its checkpoints unless
    replays may start from them (the ``none`` run: pruned after its seed's replays)."""
    steps = s.conditions[key.condition].steps
    result = train_and_decode(s, key, s.run_dir(key), steps, s.points_of(key.condition), s.summaries)
    if not (key.arm == OBSERVING_ARM and s.replays_on(key.condition)):
        prune_run(s.run_dir(key), kept_checkpoints(s, steps))
    return result


def pilot_conditions(s: Settings) -> List[str]:
    """The conditions of the plan whose budget the pilot checks: the round's and the deep one (family.json's
    budget and "depth"); not the stress condition, where nothing learns."""
    return [c for c in s.conditions if c in (s.config.condition, s.config.depth_condition)]


def run_pilot(s: Settings, condition: str) -> RunResult:
    """The pilot of ``condition``'s budget (family.json's budget.pilot, or depth.budget.pilot): the ``none``
    run of the pilot's seed trained to the pilot's steps in ``<exp-root>/pilot/`` (a pilot of an earlier, shorter
    budget trains on from its checkpoint), decoded at its points the way every run is; its summary in
    ``<summaries>/pilot/``."""
    pilot = s.config.budget_of(condition).pilot
    key = RunKey(condition, OBSERVING_ARM, pilot.seed)
    run_dir = s.exp_root / PILOT / key.relpath
    summaries = s.summaries / PILOT
    if run_done(s, key, summaries, pilot.steps):
        logging.info(f"pilot {key.relpath}: done earlier - skipped")
        return read_summary(summaries, key)
    result = train_and_decode(s, key, run_dir, pilot.steps, list(pilot.decode_at), summaries)
    prune_run(run_dir, kept_checkpoints(s, pilot.steps))
    return result


# --------------------------------------------------------------------------
# Replays
# --------------------------------------------------------------------------


def _start(matched: Optional[Matched]) -> Optional[int]:
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
    ``end`` under ``control`` (an arm, or UNIFORM: the filter arm's flags through
    :mod:`studies.ablation.uniform_filter`); no checkpoint but the last."""
    original = RunKey(key.condition, OBSERVING_ARM, key.seed)
    arm = FILTER_ARM if control == UNIFORM else control
    cmd = train_command(
        s, original, exp_dir=exp_dir, arm=arm, max_batches=end, start_batch=start, save_every_n=0, keep_last_k=0
    )
    if control == UNIFORM:
        cmd = ["python", "-m", "studies.ablation.uniform_filter", *cmd[1:]]
    return cmd


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
    prefix = s.replay_dir(key) / "prefix"
    train_segments(s, key, prefix, base, [(OBSERVING_ARM, key.start)], f"{key.relpath}/prefix", commands)
    return prefix / f"checkpoint-{key.start}.pt"


def _reference(s: Settings, key: ReplayKey, matched: Matched, commands: List[str]) -> Branch:
    """The run itself over the matched window: its losses and batch digests from its summary, its checkpoint at
    the window's end decoded and its second moments."""
    end = matched.start + s.args.replay_steps
    ref_dir = s.replay_dir(key) / MATCHED_REFERENCE
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


def _matched_branches(
    s: Settings, key: ReplayKey, matched: Optional[Matched], commands: List[str]
) -> Dict[str, Branch]:
    """Branch (d) from the matched start and its reference, the run itself over that window (none without a
    matched start)."""
    if matched is None:
        return {}
    branch_dir = s.replay_dir(key) / MATCHED
    start = run_checkpoint(s, key.condition, key.seed, matched.start, commands)
    end = matched.start + s.args.replay_steps
    train_segments(s, key, branch_dir, start, [(FILTER_ARM, end)], f"{key.relpath}/{MATCHED}", commands)
    decode_all(s, key.condition, branch_dir, (end, 1, False), f"{key.relpath}/{MATCHED}: decoding", commands)
    return {
        MATCHED: collect_branch(branch_dir, RunKey(key.condition, MATCHED, key.seed), end, s.methods, TB_TAGS),
        MATCHED_REFERENCE: _reference(s, key, matched, commands),
    }


def redo_matched(s: Settings, done: ReplayResult, matched: Optional[Matched]) -> ReplayResult:
    """A finished replay whose matched start is no longer the plan's (chosen by an earlier rule): branch (d)
    and its reference made again from ``matched``, the branches from the event kept as they are; finished as
    :func:`finish_replay`."""
    replay_dir = s.replay_dir(done.key)
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
    branches.update(_matched_branches(s, done.key, matched, commands))
    return finish_replay(s, replace(done, branches=branches, matched=matched, commands=commands))


def run_replay(s: Settings, key: ReplayKey, event: Event, matched: Optional[Matched]) -> ReplayResult:
    """Every branch of one replay (replay.py's module doc), decoded at the window's end; finished as
    :func:`finish_replay`."""
    replay_dir = s.replay_dir(key)
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
    branches.update(_matched_branches(s, key, matched, commands))
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
    replay_dir = s.replay_dir(result.key)
    result = replace(result, wall_s=folders_wall(replay_dir))
    write_summary(s.summaries, result)
    if not result.identical_batches:
        raise StudyError(f"{result.key.relpath}: the branches saw other batches than the run (see {replay_dir})")
    for path in replay_dir.rglob("*.pt"):
        path.unlink()
    return result


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


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


def write_report(
    s: Settings, command: str, date: Optional[str] = None, machine: Optional[str] = None
) -> Optional[Path]:
    """RESULTS.md's ablation section and the plots, from every summary (None when there is none); ``date``
    and ``machine`` (default: today, this machine) are the section's."""
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
    sweep = sorted({s.thresholds.grad_filter_threshold, *s.thresholds.filter_sweep})
    landscape = [comparison.arm for comparison in s.config.landscape_family]
    depths = (s.config.condition, s.config.depth_condition)
    plots = write_plots(
        results,
        s.arms,
        s.results_dir,
        sweep,
        replays,
        landscape=landscape,
        landscape_condition=s.config.condition,
        landscape_reference=s.config.family[0].arm,
        depths=depths,
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
    results_md = s.results_dir / "RESULTS.md"
    SECTION.write(
        results_md, render_section(results, replays, s.arms, plots, setup, [p for p in pilots if p], OBSERVING_ARM)
    )
    logging.info(f"wrote {results_md} and {len(plots)} plots ({len(results)} runs, {len(replays)} replays)")
    print(format_table(results, s.arms, s.methods))
    return results_md


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------


def run_plan(s: Settings, command: str) -> int:
    """Every run of the plan, seed by seed, each seed's replays after its runs (then its ``none`` run's
    checkpoints pruned); progress, an estimate of the time left, and the report after each. Returns the
    number of runs and replays made."""
    runs = s.plan.runs
    replays_total = s.replay_events if any(s.replays_on(c) for c in s.plan.conditions) else 0
    fraction = 5 * s.args.replay_steps / max(c.steps for c in s.conditions.values())
    # Runs finished earlier (a resumed plan) give the first estimate.
    earlier = [read_summary(s.summaries, k) for k in runs if run_done(s, k)]
    replayed = [
        r for c in s.plan.conditions for r in read_replay_summaries(s.summaries, c) if r.key.seed in s.plan.all_seeds
    ]
    progress = Progress(
        {
            "run": [r.wall_total_s for r in earlier if r.wall_s],
            "replay": [r.wall_total_s for r in replayed if r.wall_s],
        }
    )
    made, replays_done = 0, len(replayed)

    def log_left(i: int) -> None:
        runs_left = sum(1 for k in runs[i:] if not run_done(s, k) and k not in elsewhere)
        replays_left = max(0, replays_total - replays_done)
        per_run = progress.mean("run")
        left = runs_left * per_run + replays_left * progress.mean("replay", per_run * fraction)
        logging.info(f"{progress.eta(left)} for {runs_left} run(s) and {replays_left} replay(s)")

    elsewhere = {k: runs_on_other_cpus(s, k) for k in runs if not run_done(s, k)}
    elsewhere = {k: found for k, found in elsewhere.items() if found}
    for i, key in enumerate(runs, 1):
        if run_done(s, key):
            logging.info(f"[{i}/{len(runs)}] {key.relpath}: done earlier - skipped")
        elif key in elsewhere:
            logging.warning(
                f"[{i}/{len(runs)}] {key.relpath}: skipped, its seed's runs {'; '.join(elsewhere[key])} were made "
                f"on another CPU than this one ({cpu_name(machine_record())}), so it would pair with none of them; "
                "make it where they were made, or check first whether this CPU computes as theirs (--verify-cpu)"
            )
        else:
            logging.info(f"[{i}/{len(runs)}] {key.relpath} ({s.arms[key.arm].label}): starting")
            with progress.timing("run"):
                run_one(s, key)
            made += 1
            log_left(i)
            write_report(s, command)
        last_of_seed = i == len(runs) or runs[i].seed != key.seed
        if not last_of_seed:
            continue
        for condition in s.plan.conditions:
            if not s.replays_on(condition) or not run_done(s, RunKey(condition, OBSERVING_ARM, key.seed)):
                continue
            observed = read_summary(s.summaries, RunKey(condition, OBSERVING_ARM, key.seed))
            for rkey, event, matched in replay_plan(s, condition, key.seed):
                done = read_replay_summary(s.summaries, rkey)
                if done is not None and _start(done.matched) == _start(matched):
                    logging.info(f"{rkey.relpath}: done earlier - skipped")
                    continue
                if not pairs_here(s, observed):
                    logging.warning(
                        f"{rkey.relpath}: skipped, its run {observed.key.relpath} was made on another CPU "
                        f"({cpu_name(observed.machine)}), whose steps this one would not reproduce; make it there, "
                        "or check first whether this CPU computes as that one (--verify-cpu)"
                    )
                    continue
                if done is not None:
                    what = "made again" if matched is not None else "removed (no matched start now)"
                    logging.info(
                        f"{rkey.relpath}: done earlier with branch (d) from step {_start(done.matched)}; the plan's "
                        f"matched start is now {_start(matched)}: branch (d) and its reference {what}"
                    )
                    redo_matched(s, done, matched)
                    made += 1
                    write_report(s, command)
                    log_left(i)
                    continue
                logging.info(
                    f"{rkey.relpath}: replaying the event at step {event.step} (layer {event.layer}, "
                    f"{event.ratio:.1f}x the median); matched start {matched.start if matched else 'none found'}"
                )
                with progress.timing("replay"):
                    run_replay(s, rkey, event, matched)
                made += 1
                replays_done += 1
                write_report(s, command)
                log_left(i)
            steps = s.conditions[condition].steps
            none_dir = s.run_dir(RunKey(condition, OBSERVING_ARM, key.seed))
            prune_run(none_dir, kept_checkpoints(s, steps))
            retrained = none_dir.parent / f"seed-{key.seed}-retrained"
            if retrained.is_dir():
                prune_run(retrained, [])
    return made


def with_budget(
    c: Condition, steps: Optional[int], max_duration: Optional[float], warm: Optional[int], base_lr: Optional[float]
) -> Condition:
    """The condition with any of its budget, batch size, warm-up and learning rate overridden."""
    train_flags = list(c.train_flags)
    if base_lr is not None:
        if "--base-lr" in train_flags:
            at = train_flags.index("--base-lr")
            del train_flags[at : at + 2]
        train_flags += ["--base-lr", f"{base_lr:g}"]
    return replace(
        c,
        steps=c.steps if steps is None else steps,
        max_duration=c.max_duration if max_duration is None else max_duration,
        model_warm_step=c.model_warm_step if warm is None else warm,
        train_flags=tuple(train_flags),
    )
