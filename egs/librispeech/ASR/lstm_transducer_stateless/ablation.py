#!/usr/bin/env python3
"""The gradient-control ablation (issue 6): the same model, data, seed and
number of steps under four arms, (a) no filter and no clipping, (b)
clip_grad_norm only, (c) GradientFilter only, (d) both, each trained on the
clean training set and on a copy in which a fraction of the cuts is corrupted
(local/make_corrupted_cuts.py). Every arm trains whole epochs, so each records
a validation loss per epoch; the sampler, the seed and the cut durations are
the same in every arm, so every arm takes the same steps on the same batches.
Each arm is decoded on test-clean and test-other with the model averaged over
its last epoch. Then RESULTS.md gets the table, the measured findings and the
commands, and PNG plots are written beside it.

Usage (from egs/librispeech/ASR, after prepare.sh; `make ablation` runs both):

  ./lstm_transducer_stateless/ablation.py

Budget of the default on 2 idle CPU cores (the synthetic corpus of
prepare.sh, about 3 h; the 5.5 M-parameter cpu model): 2 epochs of about 304
batches at --max-duration 40, i.e. about 608 steps per arm (7.5-8 min of
training with the two validations, measured 2026-11-23), then greedy and
modified beam search on test-clean and test-other (about 25 s). Eight arms:
about 65-70 min.
Adding fast_beam_search (--decoding-methods greedy_search
modified_beam_search fast_beam_search) costs about 2 min more per arm.

A tiny run (what the tests do, on prepare.sh --size tiny):

  ./lstm_transducer_stateless/ablation.py --work-dir /tmp/tiny \\
      --exp-root /tmp/tiny/exp-ablation --results-dir /tmp/tiny/results \\
      --epochs 1 --max-duration 60 --decoding-methods greedy_search \\
      --model-args "--encoder-dim 32 --rnn-hidden-size 32 --dim-feedforward 64 \\
                    --num-encoder-layers 2 --decoder-dim 32 --joiner-dim 32"

Resuming: a rerun skips arms that finished
(<exp-root>/<set>/<arm>/ablation-done.json), lets train.py resume an arm that
was cut off from its newest checkpoint, decodes only what is missing, and
writes RESULTS.md and the plots again. The settings are stored in
<exp-root>/ablation-config.json; a rerun with other settings is refused (use
another --exp-root).
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


from icefall_lite.ablation.report import (
    ARMS,
    DONE_MARKER,
    TEST_SETS,
    TRAINING_SETS,
    Arm,
    ArmResult,
    ReportSetup,
    add_wall_time,
    collect_arm_result,
    format_table,
    newest_wer_summary,
    read_json,
    render_section,
    steps_note,
    update_results_md,
    write_json_atomic,
)
from icefall_lite.ablation.plots import write_plots
from icefall_lite.decoding.constants import DECODING_METHODS
from icefall_lite.data.corrupt import CORRUPTION_METHODS, IDS_FILE, read_done
from icefall_lite.utils import script_parser
from train import TB_TAGS  # this recipe's train.py (the script's folder is on sys.path, as in icefall)

RECIPE_DIR = Path(__file__).resolve().parents[1]
# icefall's RESULTS.md settings for lstm_transducer_stateless3 (beam 4 / contexts 4 / states 8).
DECODE_FLAGS = ["--beam-size", "4", "--beam", "4", "--max-contexts", "4", "--max-states", "8"]
CONFIG_FILE = "ablation-config.json"


class AblationError(RuntimeError):
    """A step of the ablation failed; the message says which and where its log is."""


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument("--work-dir", type=Path, default=RECIPE_DIR,
                        help="folder with data/ (prepare.sh --work-dir); train/decode run in it (default: the recipe)")
    parser.add_argument("--exp-root", type=Path, default=Path("lstm_transducer_stateless/exp-ablation"),
                        help="where the arms go (<exp-root>/<clean|corrupted>/<arm>/); relative to --work-dir")
    parser.add_argument("--results-dir", type=Path, default=RECIPE_DIR,
                        help="where RESULTS.md (ablation section) and the PNG plots are written (default: the recipe)")
    parser.add_argument("--epochs", type=int, default=2,
                        help="epochs per arm (whole epochs: a validation loss each; about 304 steps each at "
                        "--max-duration 40 on the default synthetic corpus)")
    parser.add_argument("--max-duration", type=float, default=40.0, help="seconds of audio per training batch")
    parser.add_argument("--decode-max-duration", type=float, default=200.0, help="seconds of audio per decoding batch")
    parser.add_argument("--seed", type=int, default=42, help="train.py --seed of every arm, and the corruption seed")
    parser.add_argument("--grad-filter-threshold", type=float, default=25.0, help="the filter's threshold where it is on")
    parser.add_argument("--clip-grad-norm", type=float, default=5.0, help="clip_grad_norm's max norm where it is on")
    parser.add_argument("--corruption", choices=CORRUPTION_METHODS, default="random-text",
                        help="how local/make_corrupted_cuts.py corrupts a cut")
    parser.add_argument("--corrupt-fraction", type=float, default=0.02, help="fraction of training cuts corrupted")
    parser.add_argument("--corrupt-density", type=float, default=0.9, help="random-text: tokens per encoder frame")
    parser.add_argument("--corrupt-scale", type=float, default=10.0, help="scale-features: the factor")
    parser.add_argument("--decoding-methods", nargs="+", choices=DECODING_METHODS,
                        default=["greedy_search", "modified_beam_search"], help="decoding methods of every arm")
    parser.add_argument("--bpe-model", type=Path, default=None,
                        help="default: the one data/lang_bpe_*/bpe.model in --work-dir")
    parser.add_argument("--model-args", type=str, default="",
                        help="model-size flags for train.py and decode.py, e.g. '--model-preset icefall' "
                        "(default: none, i.e. the cpu preset)")
    parser.add_argument("--num-workers", type=int, default=0,
                        help="DataLoader workers (0: a resumed arm reproduces the uninterrupted run exactly)")
    parser.add_argument("--save-every-n", type=int, default=40, help="checkpoint every N batches (for resuming)")
    return parser


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclass
class Settings:
    """Resolved flags: absolute paths, the BPE model found, the model flags split."""

    args: argparse.Namespace
    work_dir: Path
    exp_root: Path
    results_dir: Path
    bpe_model: Path
    model_args: List[str]
    methods: List[str]

    def rel(self, path: Path) -> str:
        """``path`` relative to the work dir when inside it (commands read better), else absolute."""
        try:
            return str(path.resolve().relative_to(self.work_dir))
        except ValueError:
            return str(path.resolve())

    def script(self, name: str) -> str:
        """A recipe script's path: relative when running in the recipe dir, else absolute."""
        path = RECIPE_DIR / name
        return name if self.work_dir == RECIPE_DIR else str(path)

    @property
    def clean_manifest_dir(self) -> Path:
        return self.work_dir / "data" / "fbank"

    @property
    def corrupted_manifest_dir(self) -> Path:
        return self.exp_root / "manifests-corrupted"

    def manifest_dir(self, training_set: str) -> Path:
        return self.clean_manifest_dir if training_set == "clean" else self.corrupted_manifest_dir

    def arm_dir(self, training_set: str, arm: Arm) -> Path:
        return self.exp_root / training_set / arm.dirname

    def stored_config(self) -> Dict:
        """What must not change between reruns into the same --exp-root."""
        a = self.args
        return {
            "epochs": a.epochs, "max_duration": a.max_duration, "seed": a.seed,
            "grad_filter_threshold": a.grad_filter_threshold, "clip_grad_norm": a.clip_grad_norm,
            "corruption": a.corruption, "corrupt_fraction": a.corrupt_fraction,
            "corrupt_density": a.corrupt_density, "corrupt_scale": a.corrupt_scale,
            "model_args": self.model_args, "bpe_model": self.rel(self.bpe_model),
            "decode_max_duration": a.decode_max_duration, "decode_flags": DECODE_FLAGS,
        }


def find_bpe_model(work_dir: Path) -> Path:
    """The single ``data/lang_bpe_*/bpe.model`` under ``work_dir``."""
    found = sorted((work_dir / "data").glob("lang_bpe_*/bpe.model"))
    if len(found) != 1:
        what = ", ".join(str(p) for p in found) if found else "none"
        raise AblationError(f"expected one data/lang_bpe_*/bpe.model in {work_dir} (found: {what}); "
                            "pass --bpe-model, or run prepare.sh first")
    return found[0]


def resolve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """Absolute paths; argparse errors for bad values."""
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.max_duration <= 0 or args.decode_max_duration <= 0:
        parser.error("--max-duration and --decode-max-duration must be positive")
    if args.grad_filter_threshold <= 0 or args.clip_grad_norm <= 0:
        parser.error("--grad-filter-threshold and --clip-grad-norm must be positive (the arms switch them off)")
    if not 0 < args.corrupt_fraction <= 1:
        parser.error(f"--corrupt-fraction must be in (0, 1], got {args.corrupt_fraction}")
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
    return Settings(args, work_dir, exp_root.resolve(), args.results_dir.resolve(), bpe.resolve(),
                    shlex.split(args.model_args), list(dict.fromkeys(args.decoding_methods)))


def check_config(settings: Settings) -> None:
    """Store the settings on the first run; refuse a rerun with other settings."""
    path = settings.exp_root / CONFIG_FILE
    wanted = settings.stored_config()
    stored = read_json(path)
    if stored is None:
        settings.exp_root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, wanted)
        return
    changed = {k: (stored.get(k), v) for k, v in wanted.items() if stored.get(k) != v}
    if changed:
        detail = "; ".join(f"{k}: was {old!r}, now {new!r}" for k, (old, new) in changed.items())
        raise AblationError(f"{settings.exp_root} was made with other settings ({detail}); "
                            "use another --exp-root, or remove it to start over")


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def corrupt_command(s: Settings) -> List[str]:
    a = s.args
    return ["python", s.script("local/make_corrupted_cuts.py"), "--src-dir", s.rel(s.clean_manifest_dir),
            "--out-dir", s.rel(s.corrupted_manifest_dir), "--bpe-model", s.rel(s.bpe_model),
            "--method", a.corruption, "--fraction", str(a.corrupt_fraction), "--seed", str(a.seed),
            "--density", str(a.corrupt_density), "--scale", str(a.corrupt_scale)]


def arm_train_flags(arm: Arm, filter_threshold: float, clip_grad_norm: float) -> List[str]:
    """train.py flags of ``arm`` (0 switches a control off)."""
    return [
        "--grad-filter-threshold", str(filter_threshold if arm.filter_on else 0),
        "--clip-grad-norm", str(clip_grad_norm if arm.clip_on else 0),
        "--clip-type", "norm",
    ]


def train_command(s: Settings, training_set: str, arm: Arm) -> List[str]:
    a = s.args
    return (["python", s.script("lstm_transducer_stateless/train.py"), "--exp-dir", s.rel(s.arm_dir(training_set, arm)),
             "--bpe-model", s.rel(s.bpe_model), "--manifest-dir", s.rel(s.manifest_dir(training_set)),
             "--num-epochs", str(a.epochs), "--seed", str(a.seed), "--max-duration", f"{a.max_duration:g}",
             "--num-workers", str(a.num_workers), "--save-every-n", str(a.save_every_n), "--keep-last-k", "1"]
            + arm_train_flags(arm, a.grad_filter_threshold, a.clip_grad_norm) + s.model_args)


def decode_checkpoint_flags(epochs: int) -> List[str]:
    """The model averaged over the last epoch (icefall's model_avg); after one epoch, that epoch's model."""
    return ["--epoch", str(epochs), "--avg", "1", "--use-averaged-model", str(epochs >= 2).lower()]


DECODE_SETTINGS = {
    "greedy_search": "greedy search (1 symbol per frame)",
    "modified_beam_search": "modified beam search (beam 4)",
    "fast_beam_search": "fast beam search (beam 4, 4 contexts, 8 states)",
}


def decoding_summary(s: Settings) -> str:
    """What the arms were decoded with, for RESULTS.md."""
    model = ("the model averaged over the last epoch" if s.args.epochs >= 2 else "the model after the epoch")
    methods = ", ".join(DECODE_SETTINGS[m] for m in s.methods)
    return f"`{shlex.join(decode_checkpoint_flags(s.args.epochs))}` ({model}); {methods} (icefall's settings)"


def decode_command(s: Settings, training_set: str, arm: Arm, method: str) -> List[str]:
    # Test sets always come from the clean manifest dir.
    return (["python", s.script("lstm_transducer_stateless/decode.py"), "--exp-dir", s.rel(s.arm_dir(training_set, arm)),
             "--bpe-model", s.rel(s.bpe_model), "--manifest-dir", s.rel(s.clean_manifest_dir),
             "--decoding-method", method, "--max-duration", f"{s.args.decode_max_duration:g}",
             "--num-workers", str(s.args.num_workers)]
            + decode_checkpoint_flags(s.args.epochs) + DECODE_FLAGS + s.model_args)


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
        raise AblationError(f"{what} failed (exit {proc.returncode}) after {elapsed:.0f} s: {shlex.join(cmd)}; "
                            f"see its output above and {log_hint}")
    return elapsed


# --------------------------------------------------------------------------
# Running the arms
# --------------------------------------------------------------------------


def decoded(arm_dir: Path, method: str) -> bool:
    return all(newest_wer_summary(arm_dir, method, t) is not None for t in TEST_SETS)


def arm_done(s: Settings, training_set: str, arm: Arm) -> bool:
    marker = read_json(s.arm_dir(training_set, arm) / DONE_MARKER)
    return marker is not None and set(s.methods) <= set(marker.get("methods", []))


def run_arm(s: Settings, training_set: str, arm: Arm) -> None:
    """Train (or resume) and decode one arm, then write its done-marker."""
    arm_dir = s.arm_dir(training_set, arm)
    arm_dir.mkdir(parents=True, exist_ok=True)
    what = f"{training_set} {arm.label}"
    if (arm_dir / f"epoch-{s.args.epochs}.pt").is_file():
        logging.info(f"{what}: epoch-{s.args.epochs}.pt exists, training finished earlier")
    else:
        start = time.time()
        try:
            run_command(s, train_command(s, training_set, arm), f"{what}: training", arm_dir / "log")
        finally:
            add_wall_time(arm_dir, "train", time.time() - start)
    for method in s.methods:
        if decoded(arm_dir, method):
            logging.info(f"{what}: {method} results exist, skipping decoding")
            continue
        start = time.time()
        try:
            run_command(s, decode_command(s, training_set, arm, method), f"{what}: {method}", arm_dir / method)
        finally:
            add_wall_time(arm_dir, f"decode/{method}", time.time() - start)
    write_json_atomic(arm_dir / DONE_MARKER, {
        "training_set": training_set, "arm": arm.dirname, "methods": s.methods,
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
    })


def run_all_arms(s: Settings) -> None:
    """Every training set x arm in order, with progress and an estimate of the time left."""
    jobs = [(t, arm) for t in TRAINING_SETS for arm in ARMS]
    start = time.time()
    ran = 0
    for i, (training_set, arm) in enumerate(jobs, 1):
        if arm_done(s, training_set, arm):
            logging.info(f"[{i}/{len(jobs)}] {training_set} {arm.label}: done earlier - skipped")
            continue
        logging.info(f"[{i}/{len(jobs)}] {training_set} {arm.label}: starting")
        run_arm(s, training_set, arm)
        ran += 1
        elapsed = time.time() - start
        left = len(jobs) - i
        logging.info(f"[{i}/{len(jobs)}] {training_set} {arm.label}: done; {elapsed / 60:.1f} min so far, "
                     f"about {elapsed / ran * left / 60:.0f} min left for {left} arm(s)")


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def collect_results(s: Settings) -> List[ArmResult]:
    """Results of all finished arms (AblationError naming the unfinished ones)."""
    missing = [f"{t}/{a.dirname}" for t in TRAINING_SETS for a in ARMS if not arm_done(s, t, a)]
    if missing:
        raise AblationError(f"unfinished arms in {s.exp_root}: {', '.join(missing)}")
    return [collect_arm_result(s.arm_dir(t, a), t, a, s.methods, TB_TAGS) for t in TRAINING_SETS for a in ARMS]


def corruption_summary(s: Settings) -> str:
    info = read_done(s.corrupted_manifest_dir) or {}
    return (f"{info.get('num_corrupted', '?')} of {info.get('num_cuts', '?')} training cuts "
            f"(fraction {s.args.corrupt_fraction}) corrupted by `{s.args.corruption}`"
            + (f" (random BPE pieces, {s.args.corrupt_density} tokens per encoder frame; features unchanged)"
               if s.args.corruption == "random-text" else f" (features x {s.args.corrupt_scale})")
            + f"; ids in `{s.rel(s.corrupted_manifest_dir / IDS_FILE)}`")


def all_commands(s: Settings) -> List[str]:
    cmds = [shlex.join(corrupt_command(s))]
    for t in TRAINING_SETS:
        for arm in ARMS:
            cmds.append(shlex.join(train_command(s, t, arm)))
            cmds.extend(shlex.join(decode_command(s, t, arm, m)) for m in s.methods)
    return cmds


def report_setup(s: Settings, results: Sequence[ArmResult], command: str) -> ReportSetup:
    """What RESULTS.md says about this run: command, setup, every command run."""
    a = s.args
    setup = (
        f"Setup: model flags `{shlex.join(s.model_args) or '(none: the cpu preset)'}`, epochs per arm: "
        f"{a.epochs}, max-duration {a.max_duration:g} s, seed {a.seed}, GradientFilter threshold "
        f"{a.grad_filter_threshold:g} where on, clip_grad_norm {a.clip_grad_norm:g} where on (otherwise train.py "
        f"defaults). {steps_note(results)} Corrupted training set: {corruption_summary(s)}. "
        f"Decoding: {decoding_summary(s)}."
    )
    return ReportSetup(command=command, setup=setup, commands=all_commands(s), methods=s.methods,
                       threshold=a.grad_filter_threshold, seed=a.seed)


def write_report(s: Settings, command: str) -> Path:
    """RESULTS.md's ablation section and the plots in --results-dir."""
    results = collect_results(s)
    plots = write_plots(results, s.results_dir, s.args.grad_filter_threshold)
    results_md = s.results_dir / "RESULTS.md"
    update_results_md(results_md, render_section(results, plots, report_setup(s, results, command)))
    logging.info(f"wrote {results_md} and {', '.join(p.name for p in plots.values())}")
    print(format_table(results, s.methods))
    return results_md


def invocation() -> str:
    """This run's command line, as typed from the recipe dir."""
    return shlex.join(["./lstm_transducer_stateless/ablation.py"] + sys.argv[1:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = get_parser()
    args = parser.parse_args(argv)
    s = resolve_settings(parser, args)
    s.exp_root.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s [%(filename)s:%(lineno)d] %(message)s", level=logging.INFO, force=True,
        handlers=[logging.StreamHandler(),
                  logging.FileHandler(s.exp_root / f"log-ablation-{datetime.datetime.now():%Y-%m-%d-%H-%M-%S}")],
    )
    logging.info(f"ablation: {vars(args)}")
    try:
        check_config(s)
        run_command(s, corrupt_command(s), "corrupted training set", s.corrupted_manifest_dir)
        run_all_arms(s)
        write_report(s, invocation())
    except (AblationError, FileNotFoundError) as e:
        logging.error(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
