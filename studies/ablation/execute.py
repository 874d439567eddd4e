"""The ablation's runs, made: train.py and decode.py commands for a run (resumable: the files a command
leaves say it has finished), a finished run read back into its summary, its checkpoints pruned, and the
pilot that checks a condition's budget."""

from __future__ import annotations

import logging
import os
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.tb_tags import TB_TAGS
from studies.ablation.arms import RunKey
from studies.ablation.runs import (
    WALL_FILE,
    RunResult,
    cpu_time_recorded,
    kept_scalars,
    read_summary,
    wall_time_kept,
    write_summary,
)
from studies.ablation.settings import (
    ARM_FILE,
    MACHINE_FILE,
    OBSERVING_ARM,
    PILOT,
    TRAINED_MARKER,
    Settings,
)
from studies.runner import (
    decode_flags,
    decoded,
    machine_record,
    read_json,
    read_wers,
    run_command,
    write_json_atomic,
)
from studies.tb_reader import read_scalars


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
