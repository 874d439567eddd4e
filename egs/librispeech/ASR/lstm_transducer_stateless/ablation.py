#!/usr/bin/env python3
"""The gradient-control ablation: what do the GradientFilter, clip_grad_norm,
or both do to an LSTM transducer's training and its WER?

Every arm (icefall_lite/ablation/arms.py) trains the same model from scratch
on the same data for the same number of steps, with the same seeds: a seed
fixes the initialisation and the batch order in every arm, so arms are
compared seed by seed (paired). Each run is decoded with greedy search on
test-clean and test-other with the weights at the end of its budget.

Sets (--set; flags below override its conditions, arms, seeds and replays):

  primary    the learnable condition `digits` (connected digits, the default
             model, --base-lr 0.003, warm-up over by step 100 of 600); arms
             none (the filter only observes), filter (GradientFilter 25),
             clip (clip_grad_norm 5), filter-clip (both), clip-relative
             (clip_grad_norm at 2x the running median); 5 seeds; and 2
             replayed outlier events per seed (below). About 3 h on 2 cores.
  secondary  the other thresholds and designs (filter-10, filter-5, agc,
             value, error-clip) with 2 seeds on `digits`, and every arm on
             the from-scratch instability `stress` (8 narrow projection
             layers at 6.7x the working learning rate, in which nothing learns).

Replays: in each `none` run, the steps after warm-up at which a layer's
largest per-sequence gradient is over the filter threshold x the batch median
are outlier events; for the largest ones, the run is resumed from its
checkpoint just before the event (--save-every-n) and trained --replay-steps
steps twice on the same batches, without and with the filter; the two
branches' losses, second moments and WERs are compared.

After every run, RESULTS.md's ablation section (tables with paired intervals,
where the outliers arise, the replays, every command) and the PNG plots
beside it are rewritten from the runs' summaries, small JSON files kept in
<results-dir>/ablation-runs/ (commit them: the report is rebuilt from them
without the run folders).

Usage (from egs/librispeech/ASR; `make ablation` prepares the digits corpus
and runs the primary set):

  bash prepare.sh --corpus digits --work-dir digits
  ./lstm_transducer_stateless/ablation.py                        # the primary set
  ./lstm_transducer_stateless/ablation.py --set secondary        # (stress needs: bash prepare.sh)
  ./lstm_transducer_stateless/ablation.py --arms none filter --num-seeds 2 --list

Resuming: a run with a summary is skipped; a run cut off part-way resumes
from its newest checkpoint in <exp-root>; a replay whose start checkpoint is
gone (another machine) retrains the `none` run up to it first (the same
seed gives the same weights). The settings that make runs comparable are
stored in <results-dir>/ablation-runs/ablation-config.json; a rerun with
other settings, or another threshold for an arm with runs, is refused (use
another --results-dir).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from icefall_lite.ablation.arms import (
    CONDITIONS,
    RUN_SETS,
    Arm,
    Condition,
    Plan,
    RunKey,
    Thresholds,
    make_arms,
    seeds_of,
    select,
)
from icefall_lite.ablation.plots import write_plots
from icefall_lite.ablation.replay import (
    BRANCHES,
    ReplayKey,
    ReplayResult,
    choose_replays,
    collect_replay,
    read_replay_summaries,
)
from icefall_lite.ablation.report import (
    RunResult,
    add_wall_time,
    collect_run,
    format_table,
    newest_wer_summary,
    read_json,
    read_summary,
    summary_path,
    update_results_md,
    write_json_atomic,
    write_summary,
)
from icefall_lite.ablation.section import ReportSetup, render_section
from icefall_lite.decoding.constants import DECODING_METHODS, TEST_SETS
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import script_parser

RECIPE_DIR = Path(__file__).resolve().parents[1]
SUMMARIES = "ablation-runs"
CONFIG_FILE = "ablation-config.json"
ARM_FILE = "ablation-arm.json"  # in every run dir: the arm's train.py flags
TRAINED_MARKER = "ablation-trained.json"  # in every run dir once train.py has finished (validation included)
OBSERVING_ARM = "none"
FILTER_ARM = "filter"
DEFAULT_THRESHOLDS = Thresholds()


class AblationError(RuntimeError):
    """A step of the ablation failed; the message says which and where its log is."""


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    t = DEFAULT_THRESHOLDS
    add = parser.add_argument
    add("--set", choices=list(RUN_SETS), default="primary", help="which set of runs (see above)")
    add("--conditions", nargs="+", default=None, choices=list(CONDITIONS), help="conditions (default: the set's)")
    add("--arms", nargs="+", default=None, help="arms (default: the set's; --list shows the plan)")
    add("--num-seeds", type=int, default=None, help="seeds per arm: --seed, --seed + 1, ... (default: the set's)")
    add("--seed", type=int, default=42, help="the first seed")
    add("--replays-per-seed", type=int, default=None, help="replayed outlier events per seed (default: the set's)")
    add("--replay-steps", type=int, default=100, help="steps of each branch of a replay")
    add("--steps", type=int, default=None, help="training steps of every run (default: the condition's)")
    add("--max-duration", type=float, default=None, help="seconds of audio per batch (default: the condition's)")
    add(
        "--model-warm-step",
        type=int,
        default=None,
        help="train.py's --model-warm-step of every run (default: the condition's; scale it with --steps)",
    )
    add(
        "--work-dir",
        type=Path,
        default=None,
        help="folder with data/ (prepare.sh --work-dir) for every condition (default: the condition's corpus "
        "folder in the recipe: digits/ or the recipe itself)",
    )
    add(
        "--exp-root",
        type=Path,
        default=Path("lstm_transducer_stateless/exp-ablation"),
        help="where the runs go (<exp-root>/<condition>/<arm>/seed-<s>/); relative to the recipe folder",
    )
    add(
        "--results-dir",
        type=Path,
        default=RECIPE_DIR,
        help="where RESULTS.md (ablation section), the PNG plots and ablation-runs/ (the run summaries) go",
    )
    add("--grad-filter-threshold", type=float, default=t.filter, help="GradientFilter threshold (arms filter*)")
    add("--filter-sweep", type=float, nargs="*", default=list(t.sweep), help="thresholds of arms filter-<t>")
    add("--clip-grad-norm", type=float, default=t.clip_norm, help="max norm of arms clip and filter-clip")
    add(
        "--relative-clip",
        type=float,
        default=t.relative_clip,
        help="arm clip-relative: clip_grad_norm at this multiple of the running median gradient norm",
    )
    add("--agc-lambda", type=float, default=t.agc_lambda, help="lambda of the agc arm (unit-wise grad / weight)")
    add("--clip-value", type=float, default=t.clip_value, help="max |gradient element| of the value arm")
    add("--error-clip", type=float, default=t.error_clip, help="max |layer-output grad| of error-clip")
    add("--model-args", type=str, default="", help="model flags after the condition's (e.g. a tiny model to try)")
    add("--decoding-methods", nargs="+", choices=DECODING_METHODS, default=["greedy_search"], help="decoding")
    add("--num-workers", type=int, default=0, help="DataLoader workers (0: a resumed run reproduces exactly)")
    add("--save-every-n", type=int, default=25, help="checkpoint every N steps (resuming; replay starts)")
    add("--list", action="store_true", help="print the runs of this invocation and exit")
    return parser


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclass
class Settings:
    """Resolved flags: the conditions (with any budget override), their data folders and BPE models, the
    arms, the plan, the paths."""

    args: argparse.Namespace
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
        raise AblationError(f"expected one data/lang_bpe_*/bpe.model in {work_dir} (found: {what})")
    return found[0]


def resolve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """The set's defaults filled in, the arms, the plan and the data folders; argparse errors for bad values."""
    run_set = RUN_SETS[args.set]
    num_seeds = run_set.num_seeds if args.num_seeds is None else args.num_seeds
    replays = run_set.replays_per_seed if args.replays_per_seed is None else args.replays_per_seed
    if num_seeds < 1 or replays < 0 or args.replay_steps < 1 or args.save_every_n < 1:
        parser.error("--num-seeds, --replay-steps and --save-every-n must be >= 1, --replays-per-seed >= 0")
    overrides = (args.steps, args.max_duration, args.model_warm_step)
    if any(x is not None and x <= 0 for x in overrides):
        parser.error("--steps, --max-duration and --model-warm-step must be positive")
    positive = {
        "--grad-filter-threshold": args.grad_filter_threshold,
        "--clip-grad-norm": args.clip_grad_norm,
        "--relative-clip": args.relative_clip,
        "--agc-lambda": args.agc_lambda,
        "--clip-value": args.clip_value,
        "--error-clip": args.error_clip,
    }
    positive.update({f"--filter-sweep {x:g}": x for x in args.filter_sweep})
    bad = [name for name, x in positive.items() if not 0 < x < float("inf")]
    if bad:
        parser.error(f"{', '.join(bad)}: thresholds must be positive and finite (the arms switch controls off)")
    thresholds = Thresholds(
        args.grad_filter_threshold,
        tuple(x for x in dict.fromkeys(args.filter_sweep) if x != args.grad_filter_threshold),
        args.clip_grad_norm,
        args.agc_lambda,
        args.clip_value,
        args.error_clip,
        args.relative_clip,
    )
    all_arms = make_arms(thresholds)
    known = [a.name for a in all_arms]
    try:
        names = select(args.arms or list(run_set.arms), known, "arm(s)")
    except ValueError as e:
        parser.error(str(e))
    arms = {a.name: a for a in all_arms}
    condition_names = list(dict.fromkeys(args.conditions or run_set.conditions))
    conditions, work_dirs, bpe_models = {}, {}, {}
    for name in condition_names:
        c = CONDITIONS[name]
        c = replace(
            c,
            steps=c.steps if args.steps is None else args.steps,
            max_duration=c.max_duration if args.max_duration is None else args.max_duration,
            model_warm_step=c.model_warm_step if args.model_warm_step is None else args.model_warm_step,
        )
        work_dir = (args.work_dir or RECIPE_DIR / c.corpus_dir).resolve()
        if not (work_dir / "data" / "fbank").is_dir():
            parser.error(
                f"condition {name}: {work_dir} has no data/fbank; run (from the recipe) "
                f"{shlex.join(c.prepare_command())}, or pass --work-dir"
            )
        try:
            bpe_models[name] = find_bpe_model(work_dir).resolve()
        except AblationError as e:
            parser.error(f"condition {name}: {e}")
        conditions[name], work_dirs[name] = c, work_dir
    plan = Plan(condition_names, [arms[n] for n in names], seeds_of(args.seed, num_seeds))
    exp_root = args.exp_root if args.exp_root.is_absolute() else RECIPE_DIR / args.exp_root
    return Settings(
        args,
        conditions,
        work_dirs,
        bpe_models,
        exp_root.resolve(),
        args.results_dir.resolve(),
        thresholds,
        arms,
        plan,
        replays,
        shlex.split(args.model_args),
    )


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
            raise AblationError(
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
                raise AblationError(
                    f"{arm_file.parent} was trained with {shlex.join(trained)}, but arm {name} is now "
                    f"{shlex.join(arm.train_flags())}; give the arm's threshold it was run with, "
                    "or use another --exp-root"
                )


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def script(s: Settings, condition: str, name: str) -> str:
    """A recipe script's path from the condition's data folder."""
    return os.path.relpath(RECIPE_DIR / name, s.work_dirs[condition])


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
            "--iter",
            str(iteration),
            "--avg",
            "1",
            "--use-averaged-model",
            "false",
            "--decoding-method",
            method,
            "--num-workers",
            str(s.args.num_workers),
        ]
        + list(s.conditions[condition].model_flags)
        + s.model_args
    )


def shown(s: Settings, condition: str, cmd: List[str]) -> str:
    """A command as typed from the recipe folder."""
    where = os.path.relpath(s.work_dirs[condition], RECIPE_DIR)
    return shlex.join(cmd) if where == "." else f"(cd {shlex.quote(where)} && {shlex.join(cmd)})"


def run_command(s: Settings, condition: str, cmd: List[str], what: str, log_hint: Path) -> float:
    """Run ``cmd`` in the condition's data folder with this Python; returns its wall time."""
    argv = [sys.executable] + cmd[1:] if cmd[0] == "python" else cmd
    logging.info(f"{what}: {shown(s, condition, cmd)}")
    start = time.time()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(argv, cwd=s.work_dirs[condition], env=env)
    elapsed = time.time() - start
    if proc.returncode != 0:
        raise AblationError(
            f"{what} failed (exit {proc.returncode}) after {elapsed:.0f} s: {shlex.join(cmd)}; "
            f"see its output above and {log_hint}"
        )
    return elapsed


# --------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------


def run_done(s: Settings, key: RunKey) -> bool:
    result = read_summary(s.summaries, key)
    return result is not None and all((m, t) in result.wer for m in s.methods for t in TEST_SETS)


def decode_all(s: Settings, condition: str, run_dir: Path, iteration: int, what: str) -> None:
    for method in s.methods:
        if all(newest_wer_summary(run_dir, method, t) is not None for t in TEST_SETS):
            continue
        start = time.time()
        try:
            run_command(s, condition, decode_command(s, condition, run_dir, method, iteration), what, run_dir)
        finally:
            add_wall_time(run_dir, f"decode/{method}", time.time() - start)


def train_run(s: Settings, key: RunKey) -> None:
    """Train (or resume) run ``key`` to the end of its budget, once."""
    run_dir = s.run_dir(key)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / ARM_FILE, {"arm": key.arm, "train_flags": s.arms[key.arm].train_flags()})
    if (run_dir / TRAINED_MARKER).is_file():
        logging.info(f"{key.relpath}: training finished earlier")
        return
    start = time.time()
    try:
        run_command(s, key.condition, train_command(s, key), f"{key.relpath}: training", run_dir / "log")
    finally:
        add_wall_time(run_dir, "train", time.time() - start)
    write_json_atomic(run_dir / TRAINED_MARKER, {"steps": s.conditions[key.condition].steps})


def run_one(s: Settings, key: RunKey) -> RunResult:
    """Train and decode one run; write its summary."""
    train_run(s, key)
    run_dir = s.run_dir(key)
    decode_all(s, key.condition, run_dir, s.conditions[key.condition].steps, f"{key.relpath}: decoding")
    c = s.conditions[key.condition]
    result = collect_run(run_dir, key, s.methods, TB_TAGS, c.warm_end)
    write_summary(s.summaries, result)
    return result


# --------------------------------------------------------------------------
# Replays
# --------------------------------------------------------------------------


def replay_plan(s: Settings, condition: str, seed: int) -> List[Tuple[ReplayKey, object]]:
    """The replays of the ``none`` run of ``condition``/``seed`` (which must be finished)."""
    original = read_summary(s.summaries, RunKey(condition, OBSERVING_ARM, seed))
    chosen = choose_replays(original, s.thresholds.filter, s.args.save_every_n, s.replays_per_seed)
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
        run_command(s, key.condition, cmd, f"{key.relpath}: retraining the none run to step {base}", redo)
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
    start = time.time()
    try:
        run_command(s, key.condition, resume_in(s, key, exp_dir, checkpoint, arm, end), what, exp_dir / "log")
    finally:
        add_wall_time(exp_dir, "train", time.time() - start)
    write_json_atomic(exp_dir / TRAINED_MARKER, {"steps": end})


def start_checkpoint(s: Settings, key: ReplayKey) -> Path:
    """``checkpoint-<start>.pt`` of the ``none`` run: its own, or made in ``<replay>/prefix`` by training on
    without control from the checkpoint before it."""
    base = base_checkpoint(s, key)
    if base.name == f"checkpoint-{key.start}.pt":
        return base
    prefix = s.replay_dir(key) / "prefix"
    continue_from(s, key, prefix, base, OBSERVING_ARM, key.start, f"{key.relpath}/prefix: to step {key.start}")
    return prefix / f"checkpoint-{key.start}.pt"


def run_replay(s: Settings, key: ReplayKey, event) -> ReplayResult:
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
        raise AblationError(f"{key.relpath}: the branches saw different batches (see their tensorboard/)")
    return result


def prune_checkpoints(s: Settings, condition: str, seed: int) -> None:
    """Once a seed's replays are done, drop the ``none`` run's intermediate checkpoints (about 100 MB each)."""
    run_dir = s.run_dir(RunKey(condition, OBSERVING_ARM, seed))
    final = s.conditions[condition].steps
    for path in run_dir.glob("checkpoint-*.pt"):
        if path.name != f"checkpoint-{final}.pt":
            path.unlink()


# --------------------------------------------------------------------------
# The plan and the report
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


def report_setup(
    s: Settings, command: str, results: Sequence[RunResult], replays: Sequence[ReplayResult]
) -> ReportSetup:
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
    return ReportSetup(
        command=command,
        conditions={name: c for name, c in s.conditions.items()},
        thresholds=s.thresholds,
        commands=commands,
        methods=s.methods,
        replay_steps=s.args.replay_steps,
        model_args=s.model_args,
    )


def write_report(s: Settings, command: str) -> Optional[Path]:
    """RESULTS.md's ablation section and the plots, from every summary (None when there is none)."""
    results = finished_results(s)
    if not results:
        return None
    replays = [r for c in s.conditions for r in read_replay_summaries(s.summaries, c)]
    sweep = sorted({s.thresholds.filter, *s.thresholds.sweep})
    plots = write_plots(results, s.arms, s.results_dir, sweep, replays)
    results_md = s.results_dir / "RESULTS.md"
    setup = report_setup(s, command, results, replays)
    update_results_md(results_md, render_section(results, replays, s.arms, plots, setup))
    logging.info(f"wrote {results_md} and {len(plots)} plots ({len(results)} runs, {len(replays)} replays)")
    print(format_table(results, s.arms, s.methods))
    return results_md


@dataclass
class Progress:
    """Time per run and per replay branch step so far, for the estimate of the time left."""

    started: float
    run_seconds: List[float]
    replay_seconds: List[float]

    def left(self, runs_left: int, replays_left: int, replay_fraction: float) -> float:
        """Seconds: the mean time of a run (and of a replay, or a run's ``replay_fraction`` before any) times
        what is left; nan before anything has been timed."""
        per_run = sum(self.run_seconds) / len(self.run_seconds) if self.run_seconds else float("nan")
        per_replay = (
            sum(self.replay_seconds) / len(self.replay_seconds) if self.replay_seconds else per_run * replay_fraction
        )
        return runs_left * per_run + replays_left * per_replay


def run_plan(s: Settings, command: str) -> int:
    """Every run of the plan, seed by seed, each seed's replays after its runs; progress, an estimate of the
    time left, and the report after each. Returns the number of runs and replays made."""
    runs = s.plan.runs
    seeds = s.plan.seeds
    replays_total = sum(s.replays_per_seed for c in s.plan.conditions if s.replays_on(c)) * len(seeds)
    fraction = 2 * s.args.replay_steps / max(c.steps for c in s.conditions.values())
    # Runs finished earlier (a resumed plan) give the first estimate.
    earlier = [read_summary(s.summaries, k) for k in runs if run_done(s, k)]
    progress = Progress(time.time(), [sum(r.wall_s.values()) for r in earlier if r.wall_s], [])
    made, replays_done = 0, 0

    def log_left(i: int) -> None:
        runs_left = sum(1 for k in runs[i:] if not run_done(s, k))
        left = progress.left(runs_left, replays_total - replays_done, fraction)
        logging.info(
            f"{(time.time() - progress.started) / 60:.1f} min so far; about {left / 60:.0f} min left for "
            f"{runs_left} run(s) and {replays_total - replays_done} replay(s)"
        )

    for i, key in enumerate(runs, 1):
        if run_done(s, key):
            logging.info(f"[{i}/{len(runs)}] {key.relpath}: done earlier - skipped")
        else:
            logging.info(f"[{i}/{len(runs)}] {key.relpath} ({s.arms[key.arm].label}): starting")
            start = time.time()
            run_one(s, key)
            progress.run_seconds.append(time.time() - start)
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
                    start = time.time()
                    run_replay(s, rkey, event)
                    progress.replay_seconds.append(time.time() - start)
                    made += 1
                    write_report(s, command)
                replays_done += 1
                log_left(i)
            prune_checkpoints(s, condition, key.seed)
    return made


def invocation(argv: Sequence[str]) -> str:
    """This run's command line, as typed from the recipe dir."""
    return shlex.join(["./lstm_transducer_stateless/ablation.py", *argv])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = get_parser()
    args = parser.parse_args(argv)
    s = resolve_settings(parser, args)
    if args.list:
        for key in s.plan.runs:
            state = "done" if run_done(s, key) else "to run"
            print(f"{key.relpath:32s} {state:7s} {s.arms[key.arm].label}")
        for c in s.plan.conditions:
            if s.replays_on(c):
                n = s.replays_per_seed * len(s.plan.seeds)
                print(f"{c}: {n} replays ({s.replays_per_seed} per seed) of {s.args.replay_steps} steps x 2 branches")
        return 0
    s.exp_root.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s [%(filename)s:%(lineno)d] %(message)s",
        level=logging.INFO,
        force=True,
        handlers=[
            logging.StreamHandler(),
            logging.FileHandler(s.exp_root / f"log-ablation-{datetime.datetime.now():%Y-%m-%d-%H-%M-%S}"),
        ],
    )
    logging.info(f"ablation: {vars(args)}")
    logging.info(
        f"{len(s.plan.runs)} runs: conditions {s.plan.conditions}, arms {[a.name for a in s.plan.arms]}, "
        f"seeds {s.plan.seeds}; {s.replays_per_seed} replay(s) per seed"
    )
    try:
        check_config(s)
        if run_plan(s, invocation(argv)) == 0:
            write_report(s, invocation(argv))
    except (AblationError, FileNotFoundError) as e:
        logging.error(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
