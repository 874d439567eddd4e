#!/usr/bin/env python3
"""The learning-speed study: which settings make the default model learn fastest
on 2 CPU cores.

Every arm trains the model from scratch for the same wall-clock budget
(``train.py --max-minutes``, validation not counted) with one change from the
defaults of the time the study was set up (plus a second seed of the
baseline, and combinations), then decodes test-clean and test-other with
greedy search using the weights at the end of the budget (``--iter <last
batch> --avg 1 --use-averaged-model false``). The budget is wall-clock, not a
number of steps, because the demo's budget is wall-clock and several levers
(batch size, model shape, vocabulary size, CTC head, tail padding) change
what a step costs.

The study was run on the 3-hour corpus of that time, ``prepare.sh --size
small``, kept in its own work dir so that it does not clash with the default
corpus in data/:

  bash prepare.sh --size small --work-dir small-corpus
  ./lstm_transducer_stateless/learning_speed.py --work-dir small-corpus  # every arm
  ./lstm_transducer_stateless/learning_speed.py --arms baseline ctc  # some arms
  ./lstm_transducer_stateless/learning_speed.py --list               # the arms

Resuming: a finished arm has <exp-root>/<arm>/learning-speed-done.json and is
skipped; an arm cut off part-way is started again from scratch (its budget is
wall-clock, so a resumed arm would not be comparable). After every arm the
"Learning speed" section of RESULTS.md is rewritten from all finished arms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence

import torch

from icefall_lite.ablation.learning_speed import (
    DONE_FILE,
    StudyArm,
    StudyResult,
    compare_to_baseline,
    format_table,
    last_checkpoint,
    read_greedy_wers,
    read_training_progress,
    seed_spread,
    simple_loss_landmark,
)
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import replace_marked_section, script_parser, write_text_atomic

RECIPE_DIR = Path(__file__).resolve().parents[1]
SECTION = "learning-speed"

# The defaults the study started from (train.py's of 2026-11-23, before the
# study changed them), given explicitly to every arm so that the arms mean the
# same after the defaults change: 4 x 256 LSTM layers (cpu preset), BPE 500
# (--base-vocab-size), --max-duration 40, Eve lr 0.003, Eden 1000/4, dropout
# 0.1, layer dropout 0.075, SpecAugment and noise mixing on, --model-warm-step
# 100, step loss ramp, no CTC head, no tail padding, GradientFilter 25,
# clip_grad_norm 5, SpecAugment without time warp (train.py's of then). An
# arm's own flags come after these and override them.
STUDY_DEFAULTS = (
    "--max-duration",
    "40",
    "--optimizer",
    "eve",
    "--base-lr",
    "0.003",
    "--lr-batches",
    "1000",
    "--lr-epochs",
    "4",
    "--dropout",
    "0.1",
    "--layer-dropout",
    "0.075",
    "--enable-spec-aug",
    "true",
    "--spec-aug-time-warp-factor",
    "-1",
    "--enable-musan",
    "true",
    "--model-warm-step",
    "100",
    "--loss-ramp",
    "step",
    "--ctc-loss-scale",
    "0",
    "--tail-pad-frames",
    "0",
    "--grad-filter-threshold",
    "25",
    "--clip-grad-norm",
    "5",
    "--model-preset",
    "cpu",
)

ARMS: List[StudyArm] = [
    StudyArm("baseline", "none (seed 42)"),
    StudyArm("baseline-seed2", "none (seed 2)", seed=2),
    StudyArm("no-specaug", "SpecAugment off", ("--enable-spec-aug", "false")),
    StudyArm("no-noise", "noise mixing off", ("--enable-musan", "false")),
    StudyArm("no-dropout", "dropout 0, layer dropout 0", ("--dropout", "0", "--layer-dropout", "0")),
    StudyArm("ctc", "CTC head, --ctc-loss-scale 0.2", ("--ctc-loss-scale", "0.2")),
    StudyArm("bpe200", "BPE vocabulary 200", vocab_size=200),
    StudyArm("bpe100", "BPE vocabulary 100", vocab_size=100),
    StudyArm("lr-0.006", "--base-lr 0.006", ("--base-lr", "0.006")),
    StudyArm(
        "eden-icefall",
        "Eden --lr-batches 5000 --lr-epochs 10 (icefall's)",
        ("--lr-batches", "5000", "--lr-epochs", "10"),
    ),
    StudyArm("batch-100", "--max-duration 100", ("--max-duration", "100")),
    StudyArm("tail-pad", "--tail-pad-frames 35 in training", ("--tail-pad-frames", "35")),
    StudyArm("warm-300", "--model-warm-step 300", ("--model-warm-step", "300")),
    StudyArm(
        "shallow-wide",
        "3 layers x 384 (no projection)",
        model_flags=(
            "--num-encoder-layers",
            "3",
            "--encoder-dim",
            "384",
            "--rnn-hidden-size",
            "384",
            "--dim-feedforward",
            "1536",
        ),
    ),
    StudyArm("linear-ramp", "--loss-ramp linear (zipformer's warm-up of the loss weights)", ("--loss-ramp", "linear")),
    StudyArm(
        "scaled-adam",
        "ScaledAdam, --base-lr 0.045, its own clipping instead of clip_grad_norm",
        ("--optimizer", "scaled-adam", "--base-lr", "0.045", "--clip-grad-norm", "0"),
    ),
    # The levers that helped beyond the seed spread on their own, together.
    StudyArm(
        "combined",
        "SpecAugment off + dropout 0, layer dropout 0 + BPE 100 (noise mixing kept)",
        ("--enable-spec-aug", "false", "--dropout", "0", "--layer-dropout", "0"),
        vocab_size=100,
    ),
]


class StudyError(RuntimeError):
    """A step of the study failed; the message says which and where its log is."""


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=RECIPE_DIR,
        help="folder with data/ (prepare.sh --work-dir); train/decode run in it",
    )
    parser.add_argument(
        "--exp-root",
        type=Path,
        default=Path("lstm_transducer_stateless/exp-learning-speed"),
        help="where the arms go (<exp-root>/<arm>/); relative to --work-dir",
    )
    parser.add_argument(
        "--results-md",
        type=Path,
        default=RECIPE_DIR / "RESULTS.md",
        help="the file whose 'Learning speed' section is rewritten",
    )
    parser.add_argument(
        "--minutes", type=float, default=5.0, help="training budget of every arm (train.py --max-minutes)"
    )
    parser.add_argument("--arms", nargs="+", default=None, help="names of the arms to run (default: all)")
    parser.add_argument(
        "--base-vocab-size",
        type=int,
        default=500,
        help="BPE vocabulary of the arms without a vocabulary change (every BPE model of the study "
        "is trained on the training transcripts into <exp-root>/lang_bpe_<N>)",
    )
    parser.add_argument("--list", action="store_true", help="print the arms and exit")
    return parser


def run_command(work_dir: Path, cmd: List[str], what: str) -> float:
    """Run ``cmd`` in ``work_dir``; returns its wall time; StudyError on failure.

    ``python <script>`` runs the recipe's script (relative to the recipe) with this interpreter.
    """
    argv = [sys.executable, str(RECIPE_DIR / cmd[1])] + cmd[2:] if cmd[0] == "python" else cmd
    logging.info(f"{what}: {shlex.join(cmd)}")
    start = time.time()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(argv, cwd=work_dir, env=env)
    elapsed = time.time() - start
    if proc.returncode != 0:
        raise StudyError(f"{what} failed (exit {proc.returncode}) after {elapsed:.0f} s: {shlex.join(cmd)}")
    return elapsed


def vocab_size_of(args: argparse.Namespace, arm: StudyArm) -> int:
    return args.base_vocab_size if arm.vocab_size is None else arm.vocab_size


def bpe_model_of(args: argparse.Namespace, arm: StudyArm) -> Path:
    """The arm's BPE model (under the exp root), relative to the work dir."""
    return args.exp_root / f"lang_bpe_{vocab_size_of(args, arm)}" / "bpe.model"


def bpe_command(args: argparse.Namespace, vocab_size: int) -> List[str]:
    lang_dir = args.exp_root / f"lang_bpe_{vocab_size}"
    return [
        "python",
        "local/train_bpe_model.py",
        "--lang-dir",
        str(lang_dir),
        "--vocab-size",
        str(vocab_size),
        "--supervisions",
        "data/manifests/librispeech_supervisions_train-clean-100.jsonl.gz",
    ]


def train_command(args: argparse.Namespace, arm: StudyArm) -> List[str]:
    return (
        [
            "python",
            "lstm_transducer_stateless/train.py",
            "--exp-dir",
            str(args.exp_root / arm.name),
            "--num-epochs",
            "100",
            "--max-minutes",
            f"{args.minutes:g}",
            "--seed",
            str(arm.seed),
            "--bpe-model",
            str(bpe_model_of(args, arm)),
        ]
        + list(STUDY_DEFAULTS)
        + list(arm.train_flags)
        + list(arm.model_flags)
    )


def decode_command(args: argparse.Namespace, arm: StudyArm, last_batch: int) -> List[str]:
    return [
        "python",
        "lstm_transducer_stateless/decode.py",
        "--exp-dir",
        str(args.exp_root / arm.name),
        "--iter",
        str(last_batch),
        "--avg",
        "1",
        "--use-averaged-model",
        "false",
        "--decoding-method",
        "greedy_search",
        "--bpe-model",
        str(bpe_model_of(args, arm)),
        "--model-preset",
        "cpu",
    ] + list(arm.model_flags)


def run_arm(args: argparse.Namespace, arm: StudyArm) -> StudyResult:
    """Train and decode one arm from scratch; write its done file."""
    exp_dir = args.work_dir / args.exp_root / arm.name
    if exp_dir.exists():
        logging.info(f"{arm.name}: removing the unfinished run in {exp_dir} (budgets are wall-clock: start over)")
        shutil.rmtree(exp_dir)
    start = time.time()
    if not (args.work_dir / bpe_model_of(args, arm)).is_file():
        vocab_size = vocab_size_of(args, arm)
        run_command(args.work_dir, bpe_command(args, vocab_size), f"{arm.name}: BPE {vocab_size}")
    run_command(args.work_dir, train_command(args, arm), f"{arm.name}: training")
    progress = read_training_progress(last_checkpoint(exp_dir))
    run_command(args.work_dir, decode_command(args, arm, progress["steps"]), f"{arm.name}: decoding")
    result = StudyResult(
        name=arm.name,
        change=arm.change,
        steps=progress["steps"],
        train_seconds=progress["train_seconds"],
        wall_seconds=time.time() - start,
        train_loss=progress["train_loss"],
        valid_loss=progress["valid_loss"],
        num_parameters=progress["num_parameters"],
        wers=read_greedy_wers(exp_dir),
        simple_below_target_step=simple_loss_landmark(exp_dir, TB_TAGS),
    )
    write_text_atomic(exp_dir / DONE_FILE, json.dumps(result.to_json(), indent=2) + "\n")
    return result


def finished_results(args: argparse.Namespace) -> List[StudyResult]:
    """Results of the finished arms, in ARMS order."""
    out = []
    for arm in ARMS:
        done = args.work_dir / args.exp_root / arm.name / DONE_FILE
        if done.is_file():
            out.append(StudyResult.from_json(json.loads(done.read_text())))
    return out


def commands_block(args: argparse.Namespace, results: Sequence[StudyResult]) -> str:
    by_name = {a.name: a for a in ARMS}
    lines = []
    for vocab_size in sorted({vocab_size_of(args, by_name[r.name]) for r in results}):
        lines.append(shlex.join(bpe_command(args, vocab_size)))
    for r in results:
        arm = by_name[r.name]
        lines.append(shlex.join(train_command(args, arm)))
        lines.append(shlex.join(decode_command(args, arm, r.steps)))
    return "\n".join(lines)


def render_section(args: argparse.Namespace, results: Sequence[StudyResult]) -> str:
    today = datetime.date.today().isoformat()
    base = [r for r in results if r.name.startswith("baseline")]
    lines = [
        "## Learning speed",
        "",
        f"Written by `./lstm_transducer_stateless/learning_speed.py` on {today} "
        f"(this project's machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        "one arm at a time on an otherwise idle machine). Every arm trains from scratch for the same "
        f"wall-clock budget, **{args.minutes:g} minutes of training** (`train.py --max-minutes`; the "
        "validation pass at the end is not counted), with one change from the defaults of 2026-11-23 "
        "(cpu preset: 4 x 256 LSTM layers, BPE 500, `--max-duration 40`, Eve lr 0.003, Eden 1000/4, "
        "dropout 0.1, layer dropout 0.075, SpecAugment and noise mixing on, `--model-warm-step 100`, "
        "GradientFilter 25 and clip_grad_norm 5 on; the commands below give these explicitly, so they mean the same "
        "after train.py's defaults changed). The budget is wall-clock rather than steps because "
        "the demo's budget is wall-clock and several levers change the cost of a step. WER: greedy "
        "search with the weights at the end of the budget (`--avg 1`, no averaging). Losses are the "
        "transducer loss per encoder frame (0.5 simple + pruned, CTC excluded): the running training "
        'loss at the end and the validation loss on dev-clean + dev-other. "simple < 0.5 at step": the first '
        "step at which the simple loss per frame, averaged over 20 steps, is below 0.5.",
        "",
        format_table(results),
        "",
    ]
    if len(base) >= 2:
        spread = {t: seed_spread(base, t) for t in TEST_SETS}
        lines.append(
            f"Seed spread of the baseline ({len(base)} seeds): {spread['test-clean']:.2f} WER points on "
            f"test-clean, {spread['test-other']:.2f} on test-other. An arm's difference from the baseline "
            "mean counts as real below only when it exceeds that spread on both test sets."
        )
        lines.append("")
        lines.append("| arm | test-clean vs baseline mean | test-other vs baseline mean | beyond the seed spread |")
        lines.append("|---|---:|---:|---|")
        for name, d_clean, d_other, real in compare_to_baseline(results, base):
            lines.append(f"| {name} | {d_clean:+.2f} | {d_other:+.2f} | {'yes' if real else 'no'} |")
        lines.append("")
    work_dir = shown_work_dir(args.work_dir)
    lines += [
        f"Commands (from egs/librispeech/ASR, after `bash prepare.sh --size small --work-dir {work_dir}`; "
        f"the study runs train.py and decode.py in `{work_dir}`):",
        "",
        "```",
        f"./lstm_transducer_stateless/learning_speed.py --work-dir {work_dir} --minutes {args.minutes:g}",
        "# which runs, per arm:",
        commands_block(args, results),
        "```",
    ]
    return "\n".join(lines)


def shown_work_dir(work_dir: Path) -> str:
    """``work_dir`` relative to the recipe folder when inside it, else as given."""
    try:
        return str(Path(work_dir).resolve().relative_to(RECIPE_DIR.resolve())) or "."
    except ValueError:
        return str(work_dir)


def main(argv: Sequence[str] = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s [learning_speed.py] %(message)s", level=logging.INFO)
    parser = get_parser()
    args = parser.parse_args(argv)
    names = [a.name for a in ARMS]
    if args.list:
        for a in ARMS:
            print(f"{a.name:14s} {a.change}")
        return 0
    unknown = [n for n in args.arms or [] if n not in names]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; known: {names}")
    if args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    args.work_dir = args.work_dir.resolve()
    supervisions = args.work_dir / "data/manifests/librispeech_supervisions_train-clean-100.jsonl.gz"
    if not supervisions.is_file() or not (args.work_dir / "data/fbank").is_dir():
        parser.error(f"no prepared data in {args.work_dir} ({supervisions} is missing): run prepare.sh first")
    selected = [a for a in ARMS if args.arms is None or a.name in args.arms]
    for i, arm in enumerate(selected, 1):
        if (args.work_dir / args.exp_root / arm.name / DONE_FILE).is_file():
            logging.info(f"[{i}/{len(selected)}] {arm.name}: done before, skipping")
            continue
        left = sum(1 for a in selected[i - 1 :] if not (args.work_dir / args.exp_root / a.name / DONE_FILE).is_file())
        logging.info(
            f"[{i}/{len(selected)}] {arm.name} ({arm.change}); about {left * (args.minutes + 1.5):.0f} min "
            "left for the remaining arms"
        )
        try:
            result = run_arm(args, arm)
        except (StudyError, FileNotFoundError, KeyError) as e:
            logging.error(str(e))
            return 1
        logging.info(f"{arm.name}: {result.steps} steps, WER {result.wers}")
        replace_marked_section(
            args.results_md,
            SECTION,
            render_section(args, finished_results(args)),
            "lstm_transducer_stateless/learning_speed.py",
        )
    replace_marked_section(
        args.results_md,
        SECTION,
        render_section(args, finished_results(args)),
        "lstm_transducer_stateless/learning_speed.py",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
