"""The ablation's runs, made: every run of the plan trained and decoded (resumable), the replayed outlier
events of each seed, and the report rewritten after each from every summary.

The recipe's entry point (``lstm_transducer_stateless/ablation.py``) turns its flags into
:class:`Settings` and calls :func:`run_plan` and :func:`write_report`; the commands, the files that say a
step is finished and the layout of the runs are here.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.tb_tags import TB_TAGS
from studies.ablation.arms import Arm, Condition, Plan, RunKey, Thresholds
from studies.ablation.metrics import format_table
from studies.ablation.plots import write_plots
from studies.ablation.replay import (
    BRANCHES,
    Event,
    ReplayKey,
    ReplayResult,
    choose_replays,
    collect_replay,
    read_replay_summaries,
)
from studies.ablation.runs import (
    RunResult,
    add_wall_time,
    collect_run,
    read_summary,
    summary_path,
    write_summary,
)
from studies.ablation.section import SECTION, ReportSetup, render_section
from studies.runner import (
    Progress,
    StudyError,
    decode_flags,
    decoded,
    machine_summary,
    read_json,
    run_command,
    today,
    write_json_atomic,
)

SUMMARIES = "ablation-runs"
CONFIG_FILE = "ablation-config.json"
ARM_FILE = "ablation-arm.json"  # in every run dir: the arm's train.py flags
TRAINED_MARKER = "ablation-trained.json"  # in every run dir once train.py has finished (validation included)
OBSERVING_ARM = "none"
FILTER_ARM = "filter"


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclass
class Settings:
    """Resolved flags: the conditions (with any budget override), their data folders and BPE models, the
    arms, the plan, the paths (``recipe_dir``: where the recipe's scripts are)."""

    args: argparse.Namespace
    recipe_dir: Path
    conditions: Dict[str, Condition]
    work_dirs: Dict[str, Path]
    bpe_models: Dict[str, Path]
    exp_root: Path
    results_dir: Path
    thresholds: Thresholds
    arms: Dict[str, Arm]
    plan: Plan
    replays_per_seed: int
    model_args: List[str]

    @property
    def methods(self) -> List[str]:
        return list(dict.fromkeys(self.args.decoding_methods))

    @property
    def summaries(self) -> Path:
        return self.results_dir / SUMMARIES

    def rel(self, path: Path, condition: str) -> str:
        """``path`` relative to the condition's data folder (where the commands run)."""
        return os.path.relpath(path.resolve(), self.work_dirs[condition])

    def run_dir(self, key: RunKey) -> Path:
        return self.exp_root / key.relpath

    def replay_dir(self, key: ReplayKey) -> Path:
        return self.exp_root / key.relpath

    def replays_on(self, condition: str) -> bool:
        return self.replays_per_seed > 0 and {OBSERVING_ARM, FILTER_ARM} <= {a.name for a in self.plan.arms}

    def stored_config(self) -> Dict:
        """What must not change between reruns into the same results."""
        return {
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
            "save_every_n": self.args.save_every_n,
        }


def find_bpe_model(work_dir: Path) -> Path:
    """The single ``data/lang_bpe_*/bpe.model`` under ``work_dir``."""
    found = sorted((work_dir / "data").glob("lang_bpe_*/bpe.model"))
    if len(found) != 1:
        what = ", ".join(str(p) for p in found) if found else "none"
        raise StudyError(f"expected one data/lang_bpe_*/bpe.model in {work_dir} (found: {what})")
    return found[0]


def stored_bpe_model(results_dir: Path, condition: str, work_dir: Path) -> Path:
    """The BPE model the condition's summaries were made with (their stored settings), in ``work_dir``."""
    stored = read_json(results_dir / SUMMARIES / CONFIG_FILE) or {}
    relpath = stored.get("conditions", {}).get(condition, {}).get("bpe_model")
    if relpath is None:
        raise StudyError(f"{results_dir / SUMMARIES / CONFIG_FILE} has no BPE model for condition {condition}")
    return work_dir / relpath


def check_config(s: Settings) -> None:
    """Store the settings on the first run; refuse a rerun with other settings for a condition already run,
    or with an arm whose flags differ from those its existing runs were trained with."""
    path = s.summaries / CONFIG_FILE
    wanted = s.stored_config()
    stored = read_json(path)
    if stored is not None:
        changed = {k: (stored.get(k), v) for k, v in wanted.items() if k != "conditions" and stored.get(k) != v}
        for name, c in wanted["conditions"].items():
            old = stored.get("conditions", {}).get(name)
            if old is not None and old != c:
                changed[f"condition {name}"] = (old, c)
        if changed:
            detail = "; ".join(f"{k}: was {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise StudyError(
                f"{s.summaries} was made with other settings ({detail}); use another --results-dir, "
                "or remove it to start over"
            )
        wanted["conditions"] = {**stored.get("conditions", {}), **wanted["conditions"]}
    s.summaries.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, wanted)
    for name, arm in s.arms.items():
        for arm_file in sorted(s.exp_root.glob(f"*/{name}/seed-*/{ARM_FILE}")):
            trained = read_json(arm_file)["train_flags"]
            if trained != arm.train_flags():
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
    s: Settings, key: RunKey, exp_dir: Optional[Path] = None, arm: Optional[str] = None, **overrides: int
) -> List[str]:
    """train.py for run ``key`` (or, with ``exp_dir``/``arm``/``overrides``, a replay branch or a retraining):
    ``overrides`` may set ``max_batches``, ``start_batch``, ``keep_last_k``."""
    a = s.args
    c = s.conditions[key.condition]
    keep = 0 if (key.arm == OBSERVING_ARM and s.replays_on(key.condition)) else 1
    flags = {
        "max_batches": overrides.get("max_batches", c.steps),
        "keep_last_k": overrides.get("keep_last_k", keep),
    }
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
            str(flags["max_batches"]),
            *start,
            "--seed",
            str(key.seed),
            "--max-duration",
            f"{c.max_duration:g}",
            "--num-workers",
            str(a.num_workers),
            "--save-every-n",
            str(a.save_every_n),
            "--keep-last-k",
            str(flags["keep_last_k"]),
        ]
        + s.arms[arm or key.arm].train_flags()
        + c.all_train_flags()
        + s.model_args
    )


def decode_command(s: Settings, condition: str, run_dir: Path, method: str, iteration: int) -> List[str]:
    return (
        [
            "python",
            script(s, condition, "lstm_transducer_stateless/decode.py"),
            "--exp-dir",
            s.rel(run_dir, condition),
            "--bpe-model",
            s.rel(s.bpe_models[condition], condition),
            *decode_flags(iteration, method),
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


def run_done(s: Settings, key: RunKey) -> bool:
    result = read_summary(s.summaries, key)
    return result is not None and all((m, t) in result.wer for m in s.methods for t in TEST_SETS)


def decode_all(s: Settings, condition: str, run_dir: Path, iteration: int, what: str) -> None:
    for method in s.methods:
        if decoded(run_dir, method):
            continue
        start = time.time()
        try:
            run(s, condition, decode_command(s, condition, run_dir, method, iteration), what, run_dir)
        finally:
            add_wall_time(run_dir, f"decode/{method}", time.time() - start)


def train_once(s: Settings, condition: str, cmd: List[str], exp_dir: Path, steps: int, what: str) -> bool:
    """Run the train.py command ``cmd`` into ``exp_dir`` unless it finished there before (its marker file);
    its wall time is added to the folder's. Returns whether it ran."""
    if (exp_dir / TRAINED_MARKER).is_file():
        return False
    start = time.time()
    try:
        run(s, condition, cmd, what, exp_dir / "log")
    finally:
        add_wall_time(exp_dir, "train", time.time() - start)
    write_json_atomic(exp_dir / TRAINED_MARKER, {"steps": steps})
    return True


def train_run(s: Settings, key: RunKey) -> None:
    """Train (or resume) run ``key`` to the end of its budget, once."""
    run_dir = s.run_dir(key)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / ARM_FILE, {"arm": key.arm, "train_flags": s.arms[key.arm].train_flags()})
    steps = s.conditions[key.condition].steps
    if not train_once(s, key.condition, train_command(s, key), run_dir, steps, f"{key.relpath}: training"):
        logging.info(f"{key.relpath}: training finished earlier")


def run_one(s: Settings, key: RunKey) -> RunResult:
    """Train and decode one run; write its summary."""
    train_run(s, key)
    run_dir = s.run_dir(key)
    c = s.conditions[key.condition]
    decode_all(s, key.condition, run_dir, c.steps, f"{key.relpath}: decoding")
    result = collect_run(run_dir, key, s.methods, TB_TAGS, c.warm_end)
    write_summary(s.summaries, result)
    return result


# --------------------------------------------------------------------------
# Replays
# --------------------------------------------------------------------------


def replay_plan(s: Settings, condition: str, seed: int) -> List[Tuple[ReplayKey, Event]]:
    """The replays of the ``none`` run of ``condition``/``seed`` (which must be finished)."""
    original = read_summary(s.summaries, RunKey(condition, OBSERVING_ARM, seed))
    chosen = choose_replays(original, s.thresholds.grad_filter_threshold, s.args.save_every_n, s.replays_per_seed)
    return [(ReplayKey(condition, seed, start), event) for start, event in chosen]


def base_checkpoint(s: Settings, key: ReplayKey) -> Path:
    """The ``none`` run's checkpoint at or before ``key.start``; retrained (same seed, same weights) when it is
    gone."""
    original = RunKey(key.condition, OBSERVING_ARM, key.seed)
    base = key.start // s.args.save_every_n * s.args.save_every_n
    path = s.run_dir(original) / f"checkpoint-{base}.pt"
    if path.is_file():
        return path
    redo = s.exp_root / key.condition / OBSERVING_ARM / f"seed-{key.seed}-retrained"
    path = redo / f"checkpoint-{base}.pt"
    if not path.is_file():
        cmd = train_command(s, original, exp_dir=redo, max_batches=base, keep_last_k=0)
        run(s, key.condition, cmd, f"{key.relpath}: retraining the none run to step {base}", redo)
    return path


def resume_in(s: Settings, key: ReplayKey, exp_dir: Path, checkpoint: Path, arm: str, end: int) -> List[str]:
    """train.py continuing the ``none`` run of ``key`` in ``exp_dir`` from ``checkpoint`` to step ``end``."""
    start = int(checkpoint.stem.split("-")[1])
    original = RunKey(key.condition, OBSERVING_ARM, key.seed)
    return train_command(s, original, exp_dir=exp_dir, arm=arm, max_batches=end, start_batch=start, keep_last_k=1)


def continue_from(s: Settings, key: ReplayKey, exp_dir: Path, checkpoint: Path, arm: str, end: int, what: str) -> None:
    """Copy ``checkpoint`` into ``exp_dir`` and train on from it to step ``end`` with ``arm``'s controls (once)."""
    exp_dir.mkdir(parents=True, exist_ok=True)
    if (exp_dir / TRAINED_MARKER).is_file():
        return
    if not (exp_dir / checkpoint.name).is_file():
        shutil.copyfile(checkpoint, exp_dir / checkpoint.name)
    train_once(s, key.condition, resume_in(s, key, exp_dir, checkpoint, arm, end), exp_dir, end, what)


def start_checkpoint(s: Settings, key: ReplayKey) -> Path:
    """``checkpoint-<start>.pt`` of the ``none`` run: its own, or made in ``<replay>/prefix`` by training on
    without control from the checkpoint before it."""
    base = base_checkpoint(s, key)
    if base.name == f"checkpoint-{key.start}.pt":
        return base
    prefix = s.replay_dir(key) / "prefix"
    continue_from(s, key, prefix, base, OBSERVING_ARM, key.start, f"{key.relpath}/prefix: to step {key.start}")
    return prefix / f"checkpoint-{key.start}.pt"


def run_replay(s: Settings, key: ReplayKey, event: Event) -> ReplayResult:
    """Both branches of one replay, decoded; its summary written."""
    replay_dir = s.replay_dir(key)
    end = key.start + s.args.replay_steps
    checkpoint = start_checkpoint(s, key)
    for branch in BRANCHES:
        branch_dir = replay_dir / branch
        what = f"{key.relpath}/{branch}"
        continue_from(s, key, branch_dir, checkpoint, branch, end, f"{what}: training")
        decode_all(s, key.condition, branch_dir, end, f"{what}: decoding")
    result = collect_replay(replay_dir, key, event, s.args.replay_steps, s.methods, TB_TAGS)
    write_summary(s.summaries, result)
    if not result.identical_batches:
        raise StudyError(f"{key.relpath}: the branches saw different batches (see their tensorboard/)")
    return result


def prune_checkpoints(s: Settings, condition: str, seed: int) -> None:
    """Once a seed's replays are done, drop the ``none`` run's intermediate checkpoints (about 100 MB each)."""
    run_dir = s.run_dir(RunKey(condition, OBSERVING_ARM, seed))
    final = s.conditions[condition].steps
    for path in run_dir.glob("checkpoint-*.pt"):
        if path.name != f"checkpoint-{final}.pt":
            path.unlink()


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


def finished_results(s: Settings) -> List[RunResult]:
    """Every summary of the conditions and arms this invocation knows (any seed), in table order."""
    out = []
    for condition in s.conditions:
        for arm in s.arms:
            for path in sorted((s.summaries / condition / arm).glob("seed-*.json")):
                result = read_summary(s.summaries, RunKey(condition, arm, int(path.stem.split("-", 1)[1])))
                if result is not None:
                    out.append(result)
    return out


def commands_run(s: Settings, results: Sequence[RunResult], replays: Sequence[ReplayResult]) -> List[str]:
    """Every command of the finished runs and replays, as typed from the recipe folder."""
    commands = []
    for r in results:
        c = r.key.condition
        if c not in s.conditions:
            continue
        commands.append(shown(s, c, train_command(s, r.key)))
        commands += [shown(s, c, decode_command(s, c, s.run_dir(r.key), m, s.conditions[c].steps)) for m in s.methods]
    for rep in replays:
        c, end = rep.key.condition, rep.key.start + rep.steps
        base = rep.key.start // s.args.save_every_n * s.args.save_every_n
        base_ckpt = s.run_dir(RunKey(c, OBSERVING_ARM, rep.key.seed)) / f"checkpoint-{base}.pt"
        start_ckpt = base_ckpt
        if base != rep.key.start:
            prefix = s.replay_dir(rep.key) / "prefix"
            commands.append(f"mkdir -p {s.rel(prefix, c)} && cp {s.rel(base_ckpt, c)} {s.rel(prefix, c)}/")
            commands.append(shown(s, c, resume_in(s, rep.key, prefix, base_ckpt, OBSERVING_ARM, rep.key.start)))
            start_ckpt = prefix / f"checkpoint-{rep.key.start}.pt"
        for branch in BRANCHES:
            branch_dir = s.replay_dir(rep.key) / branch
            commands.append(f"mkdir -p {s.rel(branch_dir, c)} && cp {s.rel(start_ckpt, c)} {s.rel(branch_dir, c)}/")
            commands.append(shown(s, c, resume_in(s, rep.key, branch_dir, start_ckpt, branch, end)))
            commands += [shown(s, c, decode_command(s, c, branch_dir, m, end)) for m in s.methods]
    return commands


def write_report(
    s: Settings, command: str, date: Optional[str] = None, machine: Optional[str] = None
) -> Optional[Path]:
    """RESULTS.md's ablation section and the plots, from every summary (None when there is none); ``date``
    and ``machine`` (default: today, this machine) are the section's."""
    results = finished_results(s)
    if not results:
        return None
    replays = [r for c in s.conditions for r in read_replay_summaries(s.summaries, c)]
    sweep = sorted({s.thresholds.grad_filter_threshold, *s.thresholds.filter_sweep})
    plots = write_plots(results, s.arms, s.results_dir, sweep, replays)
    setup = ReportSetup(
        command=command,
        conditions=dict(s.conditions),
        thresholds=s.thresholds,
        commands=commands_run(s, results, replays),
        methods=s.methods,
        replay_steps=s.args.replay_steps,
        model_args=s.model_args,
        date=date or today(),
        machine=machine or machine_summary(),
    )
    results_md = s.results_dir / "RESULTS.md"
    SECTION.write(results_md, render_section(results, replays, s.arms, plots, setup, OBSERVING_ARM))
    logging.info(f"wrote {results_md} and {len(plots)} plots ({len(results)} runs, {len(replays)} replays)")
    print(format_table(results, s.arms, s.methods))
    return results_md


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------


def run_plan(s: Settings, command: str) -> int:
    """Every run of the plan, seed by seed, each seed's replays after its runs; progress, an estimate of the
    time left, and the report after each. Returns the number of runs and replays made."""
    runs = s.plan.runs
    replays_total = sum(s.replays_per_seed for c in s.plan.conditions if s.replays_on(c)) * len(s.plan.seeds)
    fraction = 2 * s.args.replay_steps / max(c.steps for c in s.conditions.values())
    # Runs finished earlier (a resumed plan) give the first estimate.
    earlier = [read_summary(s.summaries, k) for k in runs if run_done(s, k)]
    progress = Progress({"run": [sum(r.wall_s.values()) for r in earlier if r.wall_s]})
    made, replays_done = 0, 0

    def log_left(i: int) -> None:
        runs_left = sum(1 for k in runs[i:] if not run_done(s, k))
        replays_left = replays_total - replays_done
        per_run = progress.mean("run")
        left = runs_left * per_run + replays_left * progress.mean("replay", per_run * fraction)
        logging.info(f"{progress.eta(left)} for {runs_left} run(s) and {replays_left} replay(s)")

    for i, key in enumerate(runs, 1):
        if run_done(s, key):
            logging.info(f"[{i}/{len(runs)}] {key.relpath}: done earlier - skipped")
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
            for rkey, event in replay_plan(s, condition, key.seed):
                if summary_path(s.summaries, rkey).is_file():
                    logging.info(f"{rkey.relpath}: done earlier - skipped")
                else:
                    logging.info(
                        f"{rkey.relpath}: replaying the event at step {event.step} (layer {event.layer}, "
                        f"{event.ratio:.1f}x the median)"
                    )
                    with progress.timing("replay"):
                        run_replay(s, rkey, event)
                    made += 1
                    write_report(s, command)
                replays_done += 1
                log_left(i)
            prune_checkpoints(s, condition, key.seed)
    return made
