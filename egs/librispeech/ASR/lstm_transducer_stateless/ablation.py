#!/usr/bin/env python3
"""The gradient-control ablation: does the GradientFilter help, and how does
it compare with clip_grad_norm and the other clipping designs?

Every arm (icefall_lite/ablation/arms.py) trains the same model from scratch
on the same data for the same number of steps (train.py --max-batches), with
--num-seeds seeds, under each chosen training condition:

  stress   8 LSTM layers of d_model 128 with projection (hidden 384) at
           --base-lr 0.02, the condition in which per-sequence gradient
           outliers arise by themselves (RESULTS.md, "Stress conditions")
  default  the default model at the default learning rate (no outliers)

Arms: none (the filter only observes: per-layer statistics, gradients
untouched), clip (clip_grad_norm), filter (GradientFilter), filter-clip
(both, the recipe's design), filter-<t> (the threshold sweep), agc, value,
error-clip. Each run is decoded on test-clean and test-other with greedy
search using the weights at the end of its budget. After every run, RESULTS.md's
ablation section (mean ± standard deviation over seeds, where the outliers
arise per layer, which differences are beyond the seed spread, every
command) and the PNG plots beside it are rewritten from the finished runs.

Usage (from egs/librispeech/ASR, after prepare.sh; `make ablation` runs both):

  ./lstm_transducer_stateless/ablation.py                       # the default set
  ./lstm_transducer_stateless/ablation.py --num-seeds 5 --conditions stress default
  ./lstm_transducer_stateless/ablation.py --arms none filter --list   # what would run

Budget of the default set on 2 idle CPU cores: 9 arms x 3 seeds of the
stress condition, 300 steps each at train.py's --max-duration (RESULTS.md gives the
measured time).

Resuming: a finished run has <exp-root>/<condition>/<arm>/seed-<s>/ablation-done.json
and is skipped; a run cut off part-way resumes from its newest checkpoint
(--save-every-n); a finished training is not repeated. The settings that
make runs comparable are stored in <exp-root>/ablation-config.json, and each
run's arm flags in its ablation-arm.json; a rerun with other settings, or
with another threshold for an arm that has runs, is refused (use another
--exp-root); more seeds, arms or conditions can be added to the same
--exp-root.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from icefall_lite.ablation.arms import (
    CONDITIONS,
    Arm,
    Plan,
    RunKey,
    Thresholds,
    make_arms,
    seeds_of,
    select,
)
from icefall_lite.ablation.plots import write_plots
from icefall_lite.ablation.report import (
    DONE_MARKER,
    ReportSetup,
    RunResult,
    add_wall_time,
    collect_run,
    format_table,
    newest_wer_summary,
    read_json,
    render_section,
    update_results_md,
    write_json_atomic,
)
from icefall_lite.decoding.constants import DECODING_METHODS, TEST_SETS
from icefall_lite.recipe_defaults import TRAIN_MAX_DURATION
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import script_parser

RECIPE_DIR = Path(__file__).resolve().parents[1]
CONFIG_FILE = "ablation-config.json"
ARM_FILE = "ablation-arm.json"  # in every run dir: the arm's train.py flags
TRAINED_MARKER = "ablation-trained.json"  # in every run dir once train.py has finished (validation included)
DEFAULT_THRESHOLDS = Thresholds()


class AblationError(RuntimeError):
    """A step of the ablation failed; the message says which and where its log is."""


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    t = DEFAULT_THRESHOLDS
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=RECIPE_DIR,
        help="folder with data/ (prepare.sh --work-dir); train/decode run in it (default: the recipe)",
    )
    parser.add_argument(
        "--exp-root",
        type=Path,
        default=Path("lstm_transducer_stateless/exp-ablation"),
        help="where the runs go (<exp-root>/<condition>/<arm>/seed-<s>/); relative to --work-dir",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RECIPE_DIR,
        help="where RESULTS.md (ablation section) and the PNG plots are written (default: the recipe)",
    )
    parser.add_argument(
        "--conditions", nargs="+", default=["stress"], choices=list(CONDITIONS), help="training conditions to run"
    )
    parser.add_argument("--arms", nargs="+", default=None, help="arms to run (default: all; --list shows them)")
    parser.add_argument("--num-seeds", type=int, default=3, help="seeds per arm: --seed, --seed + 1, ...")
    parser.add_argument("--seed", type=int, default=42, help="the first seed")
    parser.add_argument("--steps", type=int, default=300, help="training steps of every run (train.py --max-batches)")
    parser.add_argument(
        "--max-duration", type=float, default=TRAIN_MAX_DURATION, help="seconds of audio per training batch"
    )
    parser.add_argument(
        "--grad-filter-threshold",
        type=float,
        default=t.filter,
        help="GradientFilter threshold of the arms filter and filter-clip (the recipe's)",
    )
    parser.add_argument(
        "--filter-sweep",
        type=float,
        nargs="*",
        default=list(t.sweep),
        help="other GradientFilter thresholds, one arm filter-<t> each",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=float,
        default=t.clip_norm,
        help="clip_grad_norm's max norm in the arms clip and filter-clip (the recipe's)",
    )
    parser.add_argument(
        "--agc-lambda",
        type=float,
        default=t.agc_lambda,
        help="lambda of the agc arm (max unit-wise gradient norm / weight norm)",
    )
    parser.add_argument(
        "--clip-value", type=float, default=t.clip_value, help="max |gradient element| of the value arm"
    )
    parser.add_argument(
        "--error-clip",
        type=float,
        default=t.error_clip,
        help="max |element| of the gradient at every encoder layer's output in the error-clip arm",
    )
    parser.add_argument(
        "--model-args",
        type=str,
        default="",
        help="model flags for train.py and decode.py after the condition's, e.g. a smaller model "
        "for a quick try (default: none)",
    )
    parser.add_argument(
        "--decoding-methods",
        nargs="+",
        choices=DECODING_METHODS,
        default=["greedy_search"],
        help="decoding methods of every run",
    )
    parser.add_argument(
        "--bpe-model", type=Path, default=None, help="default: the one data/lang_bpe_*/bpe.model in --work-dir"
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="DataLoader workers (0: a resumed run reproduces the uninterrupted one exactly)",
    )
    parser.add_argument("--save-every-n", type=int, default=50, help="checkpoint every N steps (for resuming)")
    parser.add_argument("--list", action="store_true", help="print the runs of this invocation and exit")
    return parser


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclass
class Settings:
    """Resolved flags: absolute paths, the BPE model found, the arms and the plan."""

    args: argparse.Namespace
    work_dir: Path
    exp_root: Path
    results_dir: Path
    bpe_model: Path
    thresholds: Thresholds
    arms: Dict[str, Arm]
    plan: Plan
    model_args: List[str]

    @property
    def methods(self) -> List[str]:
        return list(dict.fromkeys(self.args.decoding_methods))

    def rel(self, path: Path) -> str:
        """``path`` relative to the work dir when inside it (commands read better), else absolute."""
        try:
            return str(path.resolve().relative_to(self.work_dir))
        except ValueError:
            return str(path.resolve())

    def script(self, name: str) -> str:
        """A recipe script's path: relative when running in the recipe dir, else absolute."""
        return name if self.work_dir == RECIPE_DIR else str(RECIPE_DIR / name)

    def run_dir(self, key: RunKey) -> Path:
        return self.exp_root / key.relpath

    def stored_config(self) -> Dict:
        """What must not change between reruns into the same --exp-root."""
        a = self.args
        return {
            "steps": a.steps,
            "max_duration": a.max_duration,
            "conditions": {name: [list(c.model_flags), list(c.train_flags)] for name, c in CONDITIONS.items()},
            "bpe_model": self.rel(self.bpe_model),
            "model_args": self.model_args,
        }


def find_bpe_model(work_dir: Path) -> Path:
    """The single ``data/lang_bpe_*/bpe.model`` under ``work_dir``."""
    found = sorted((work_dir / "data").glob("lang_bpe_*/bpe.model"))
    if len(found) != 1:
        what = ", ".join(str(p) for p in found) if found else "none"
        raise AblationError(
            f"expected one data/lang_bpe_*/bpe.model in {work_dir} (found: {what}); "
            "pass --bpe-model, or run prepare.sh first"
        )
    return found[0]


def resolve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """Absolute paths, the arms and the plan; argparse errors for bad values."""
    if args.steps < 1 or args.num_seeds < 1:
        parser.error(f"--steps and --num-seeds must be >= 1, got {args.steps} and {args.num_seeds}")
    if args.max_duration <= 0:
        parser.error("--max-duration must be positive")
    positive = {
        "--grad-filter-threshold": args.grad_filter_threshold,
        "--clip-grad-norm": args.clip_grad_norm,
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
    )
    all_arms = make_arms(thresholds)
    try:
        names = select(args.arms, [a.name for a in all_arms], "arm(s)") if args.arms else [a.name for a in all_arms]
    except ValueError as e:
        parser.error(str(e))
    arms = {a.name: a for a in all_arms}
    plan = Plan(list(dict.fromkeys(args.conditions)), [arms[n] for n in names], seeds_of(args.seed, args.num_seeds))
    work_dir = args.work_dir.resolve()
    if not (work_dir / "data" / "fbank").is_dir():
        parser.error(f"--work-dir {work_dir} has no data/fbank; run prepare.sh (with --work-dir) first")
    exp_root = args.exp_root if args.exp_root.is_absolute() else work_dir / args.exp_root
    bpe = args.bpe_model
    try:
        bpe = find_bpe_model(work_dir) if bpe is None else (bpe if bpe.is_absolute() else work_dir / bpe)
    except AblationError as e:
        parser.error(str(e))
    if not bpe.is_file():
        parser.error(f"--bpe-model {bpe} does not exist")
    return Settings(
        args,
        work_dir,
        exp_root.resolve(),
        args.results_dir.resolve(),
        bpe.resolve(),
        thresholds,
        arms,
        plan,
        shlex.split(args.model_args),
    )


def check_config(s: Settings) -> None:
    """Store the settings on the first run; refuse a rerun with other settings, or with an arm whose
    threshold differs from the one its existing runs were trained with."""
    path = s.exp_root / CONFIG_FILE
    wanted = s.stored_config()
    stored = read_json(path)
    if stored is None:
        s.exp_root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, wanted)
        return
    changed = {k: (stored.get(k), v) for k, v in wanted.items() if stored.get(k) != v}
    if changed:
        detail = "; ".join(f"{k}: was {old!r}, now {new!r}" for k, (old, new) in changed.items())
        raise AblationError(
            f"{s.exp_root} was made with other settings ({detail}); use another --exp-root, or remove it to start over"
        )
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


def train_command(s: Settings, key: RunKey) -> List[str]:
    a = s.args
    condition = CONDITIONS[key.condition]
    return (
        [
            "python",
            s.script("lstm_transducer_stateless/train.py"),
            "--exp-dir",
            s.rel(s.run_dir(key)),
            "--bpe-model",
            s.rel(s.bpe_model),
            "--num-epochs",
            "100",
            "--max-batches",
            str(a.steps),
            "--seed",
            str(key.seed),
            "--max-duration",
            f"{a.max_duration:g}",
            "--num-workers",
            str(a.num_workers),
            "--save-every-n",
            str(a.save_every_n),
            "--keep-last-k",
            "1",
        ]
        + s.arms[key.arm].train_flags()
        + list(condition.model_flags)
        + list(condition.train_flags)
        + s.model_args
    )


def decode_command(s: Settings, key: RunKey, method: str) -> List[str]:
    return (
        [
            "python",
            s.script("lstm_transducer_stateless/decode.py"),
            "--exp-dir",
            s.rel(s.run_dir(key)),
            "--bpe-model",
            s.rel(s.bpe_model),
            "--iter",
            str(s.args.steps),
            "--avg",
            "1",
            "--use-averaged-model",
            "false",
            "--decoding-method",
            method,
            "--num-workers",
            str(s.args.num_workers),
        ]
        + list(CONDITIONS[key.condition].model_flags)
        + s.model_args
    )


def run_command(s: Settings, cmd: List[str], what: str, log_hint: Path) -> float:
    """Run ``cmd`` in the work dir with this Python; returns its wall time. AblationError on failure."""
    argv = [sys.executable] + cmd[1:] if cmd[0] == "python" else cmd
    logging.info(f"{what}: {shlex.join(cmd)}")
    start = time.time()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(argv, cwd=s.work_dir, env=env)
    elapsed = time.time() - start
    if proc.returncode != 0:
        raise AblationError(
            f"{what} failed (exit {proc.returncode}) after {elapsed:.0f} s: {shlex.join(cmd)}; "
            f"see its output above and {log_hint}"
        )
    return elapsed


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def run_done(s: Settings, key: RunKey) -> bool:
    marker = read_json(s.run_dir(key) / DONE_MARKER)
    return marker is not None and set(s.methods) <= set(marker.get("methods", []))


def decoded(run_dir: Path, method: str) -> bool:
    return all(newest_wer_summary(run_dir, method, t) is not None for t in TEST_SETS)


def run_one(s: Settings, key: RunKey) -> None:
    """Train (or resume) and decode one run, then write its done-marker."""
    run_dir = s.run_dir(key)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / ARM_FILE, {"arm": key.arm, "train_flags": s.arms[key.arm].train_flags()})
    what = key.relpath
    if (run_dir / TRAINED_MARKER).is_file():
        logging.info(f"{what}: training finished earlier")
    else:
        start = time.time()
        try:
            run_command(s, train_command(s, key), f"{what}: training", run_dir / "log")
        finally:
            add_wall_time(run_dir, "train", time.time() - start)
        write_json_atomic(run_dir / TRAINED_MARKER, {"steps": s.args.steps})
    for method in s.methods:
        if decoded(run_dir, method):
            continue
        start = time.time()
        try:
            run_command(s, decode_command(s, key, method), f"{what}: {method}", run_dir / method)
        finally:
            add_wall_time(run_dir, f"decode/{method}", time.time() - start)
    write_json_atomic(
        run_dir / DONE_MARKER,
        {
            "condition": key.condition,
            "arm": key.arm,
            "seed": key.seed,
            "methods": s.methods,
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        },
    )


def finished_results(s: Settings) -> List[RunResult]:
    """Every finished run in the exp root whose arm this invocation knows (any seed), in table order:
    condition, arm, seed."""
    out = []
    for condition in CONDITIONS:
        for arm in s.arms:
            arm_dir = s.exp_root / condition / arm
            seeds = sorted(int(p.name.split("-", 1)[1]) for p in arm_dir.glob("seed-*") if p.name[5:].isdigit())
            for seed in seeds:
                key = RunKey(condition, arm, seed)
                if run_done(s, key):
                    out.append(collect_run(s.run_dir(key), key, s.methods, TB_TAGS))
    return out


def setup_text(s: Settings, results: Sequence[RunResult]) -> str:
    """The setup paragraph of RESULTS.md."""
    a, t = s.args, s.thresholds
    conditions = "; ".join(
        f"**{c}**: {CONDITIONS[c].description}" for c in dict.fromkeys(r.key.condition for r in results)
    )
    return (
        f"Every run trains from scratch for **{a.steps} steps** (`--max-batches`) at `--max-duration "
        f"{a.max_duration:g}`, on the data of `prepare.sh` (BPE model `{s.rel(s.bpe_model)}`), everything else "
        f"train.py's defaults; the seeds differ in initialisation and data order. Conditions: {conditions}. "
        "Arms: `none` has no control, its GradientFilter only observing (`--grad-filter-threshold inf`: the "
        "statistics, gradients untouched; every arm without the filter observes the same way). Thresholds: "
        f"GradientFilter {t.filter:g} (the recipe's and icefall's stateless3) and the sweep "
        f"{', '.join(f'{x:g}' for x in t.sweep)}; clip_grad_norm {t.clip_norm:g} (the recipe's); AGC lambda "
        f"{t.agc_lambda:g} (the paper's value for small batches; our batches hold 5-20 utterances); clip by value "
        f"{t.clip_value:g} and error clip {t.error_clip:g} (per element; how these defaults were chosen: the section "
        '"Thresholds of the ablation\'s clipping arms" below). Decoding: '
        + ", ".join(s.methods)
        + f" with the weights at step {a.steps} (`--iter {a.steps} --avg 1`)."
        + (f" Model flags after the condition's: `{shlex.join(s.model_args)}`." if s.model_args else "")
    )


def all_commands(s: Settings, results: Sequence[RunResult]) -> List[str]:
    cmds = []
    for r in results:
        cmds.append(shlex.join(train_command(s, r.key)))
        cmds.extend(shlex.join(decode_command(s, r.key, m)) for m in s.methods)
    return cmds


def write_report(s: Settings, command: str) -> Optional[Path]:
    """RESULTS.md's ablation section and the plots, from every finished run (None when there is none)."""
    results = finished_results(s)
    if not results:
        return None
    sweep = sorted({s.thresholds.filter, *s.thresholds.sweep})
    plots = write_plots(results, s.arms, s.results_dir, sweep)
    setup = ReportSetup(
        command=command, setup=setup_text(s, results), commands=all_commands(s, results), methods=s.methods, sweep=sweep
    )
    results_md = s.results_dir / "RESULTS.md"
    update_results_md(results_md, render_section(results, s.arms, plots, setup))
    logging.info(f"wrote {results_md} and {len(plots)} plots ({len(results)} finished runs)")
    print(format_table(results, s.arms, s.methods))
    return results_md


def run_plan(s: Settings, command: str) -> int:
    """Every run of the plan in order, with progress, an estimate of the time left, and the report after each;
    returns the number of runs made."""
    runs = s.plan.runs
    start = time.time()
    ran = 0
    for i, key in enumerate(runs, 1):
        if run_done(s, key):
            logging.info(f"[{i}/{len(runs)}] {key.relpath}: done earlier - skipped")
            continue
        logging.info(f"[{i}/{len(runs)}] {key.relpath} ({s.arms[key.arm].label}): starting")
        run_one(s, key)
        ran += 1
        elapsed = time.time() - start
        left = sum(1 for k in runs[i:] if not run_done(s, k))
        logging.info(
            f"[{i}/{len(runs)}] {key.relpath}: done; {elapsed / 60:.1f} min so far, "
            f"about {elapsed / ran * left / 60:.0f} min left for {left} run(s)"
        )
        write_report(s, command)
    return ran


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
            print(f"{key.relpath:32s} {'done' if run_done(s, key) else 'to run'}  {s.arms[key.arm].label}")
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
        f"seeds {s.plan.seeds}"
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
