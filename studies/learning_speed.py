"""The learning-speed study (``lstm_transducer_stateless/learning_speed.py``): which settings make the
default model learn fastest on 2 CPU cores.

An arm is one training run of ``train.py`` under a wall-clock budget (``--max-minutes``) with one change
from the defaults of the time the study was set up, decoded with greedy search on test-clean and test-other
with the weights at the end of the budget. Here: the arms, their commands, one arm run and read back (the
last checkpoint's progress entries, the wer-summary files, the simple-loss landmark), and the RESULTS.md
section (the table, the seed spread of the baseline and every arm against it, the commands).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.checkpoint import find_checkpoints, load_checkpoint_file
from icefall_lite.train.tb_tags import TB_TAGS, TrainingScalarTags
from icefall_lite.utils import write_text_atomic
from studies.runner import Section, decode_flags, read_wers, run_command, today
from studies.tb_reader import Series, moving_average, read_scalars

SECTION = Section("learning-speed", "lstm_transducer_stateless/learning_speed.py")
DONE_FILE = "learning-speed-done.json"
SIMPLE_LOSS_TARGET = 0.5  # per frame; the landmark of the warm-up
SIMPLE_LOSS_WINDOW = 20  # steps of the moving average


@dataclass(frozen=True)
class StudyArm:
    """One arm: a name, what it changes, and the flags that change it.

    Args:
      name: folder name under the study's exp root (``baseline``, ``no-specaug``).
      change: the change from the defaults, in words, for the table.
      train_flags: extra ``train.py`` flags.
      vocab_size: BPE vocabulary of the arm (None: the default BPE model).
      model_flags: model-size flags, given to both train.py and decode.py.
      seed: ``train.py --seed``.
    """

    name: str
    change: str
    train_flags: Tuple[str, ...] = ()
    vocab_size: Optional[int] = None
    model_flags: Tuple[str, ...] = ()
    seed: int = 42


@dataclass
class StudyResult:
    """What a finished arm measured."""

    name: str
    change: str
    steps: int
    train_seconds: float
    wall_seconds: float
    train_loss: float
    valid_loss: float
    num_parameters: int
    wers: Dict[str, float] = field(default_factory=dict)  # test set -> greedy WER %
    simple_below_target_step: Optional[int] = None  # first step where the smoothed simple loss < 0.5

    def to_json(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Dict) -> "StudyResult":
        return cls(**data)


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


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


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
        *decode_flags(last_batch, "greedy_search"),
        "--bpe-model",
        str(bpe_model_of(args, arm)),
        "--model-preset",
        "cpu",
    ] + list(arm.model_flags)


# --------------------------------------------------------------------------
# One arm, run and read back
# --------------------------------------------------------------------------


def last_checkpoint(exp_dir: Path) -> Path:
    """The ``checkpoint-<batch>.pt`` with the highest batch in ``exp_dir`` (FileNotFoundError if none)."""
    found = find_checkpoints(exp_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint-<batch>.pt in {exp_dir}: the arm did not finish training")
    return found[0]


def read_training_progress(checkpoint: Path) -> Dict[str, float]:
    """Steps, training seconds, final train/validation loss and parameter count stored in a checkpoint."""
    ckpt = load_checkpoint_file(checkpoint)
    missing = [k for k in ("batch_idx_train", "train_seconds", "train_loss", "valid_loss") if k not in ckpt]
    if missing:
        raise KeyError(f"{checkpoint} lacks {missing}: was it written by train.py with --max-minutes?")
    return {
        "steps": int(ckpt["batch_idx_train"]),
        "train_seconds": float(ckpt["train_seconds"]),
        "train_loss": float(ckpt["train_loss"]),
        "valid_loss": float(ckpt["valid_loss"]),
        "num_parameters": int(ckpt.get("num_parameters", 0)),
    }


def first_step_below(series: Series, target: float, window: int) -> Optional[int]:
    """The first step at which the ``window``-step moving average of ``series`` is below ``target``."""
    for step, value in moving_average(series, window):
        if value < target:
            return step
    return None


def simple_loss_landmark(exp_dir: Path, tags: TrainingScalarTags) -> Optional[int]:
    """First training step where the simple loss per frame (TensorBoard ``tags.simple_loss``,
    averaged over ``SIMPLE_LOSS_WINDOW`` steps) falls below ``SIMPLE_LOSS_TARGET``; None if never."""
    series = read_scalars(exp_dir / "tensorboard", [tags.simple_loss]).get(tags.simple_loss, [])
    return first_step_below(series, SIMPLE_LOSS_TARGET, SIMPLE_LOSS_WINDOW)


def done_file(args: argparse.Namespace, arm: StudyArm) -> Path:
    """The file that says the arm has finished (its result): ``<work dir>/<exp root>/<arm>/``."""
    return args.work_dir / args.exp_root / arm.name / DONE_FILE


def run_arm(args: argparse.Namespace, arm: StudyArm, recipe_dir: Path) -> StudyResult:
    """Train and decode one arm from scratch with the scripts of ``recipe_dir``; write its done file."""
    exp_dir = args.work_dir / args.exp_root / arm.name
    if exp_dir.exists():
        logging.info(f"{arm.name}: removing the unfinished run in {exp_dir} (budgets are wall-clock: start over)")
        shutil.rmtree(exp_dir)
    start = time.time()
    if not (args.work_dir / bpe_model_of(args, arm)).is_file():
        vocab_size = vocab_size_of(args, arm)
        run_command(bpe_command(args, vocab_size), args.work_dir, f"{arm.name}: BPE {vocab_size}", scripts=recipe_dir)
    run_command(train_command(args, arm), args.work_dir, f"{arm.name}: training", scripts=recipe_dir)
    progress = read_training_progress(last_checkpoint(exp_dir))
    decode = decode_command(args, arm, progress["steps"])
    run_command(decode, args.work_dir, f"{arm.name}: decoding", scripts=recipe_dir)
    result = StudyResult(
        name=arm.name,
        change=arm.change,
        steps=progress["steps"],
        train_seconds=progress["train_seconds"],
        wall_seconds=time.time() - start,
        train_loss=progress["train_loss"],
        valid_loss=progress["valid_loss"],
        num_parameters=progress["num_parameters"],
        wers={t: wer for (_, t), wer in read_wers(exp_dir, ["greedy_search"]).items()},
        simple_below_target_step=simple_loss_landmark(exp_dir, TB_TAGS),
    )
    write_text_atomic(done_file(args, arm), json.dumps(result.to_json(), indent=2) + "\n")
    return result


def finished_results(args: argparse.Namespace) -> List[StudyResult]:
    """Results of the finished arms, in ARMS order."""
    out = []
    for arm in ARMS:
        done = done_file(args, arm)
        if done.is_file():
            out.append(StudyResult.from_json(json.loads(done.read_text())))
    return out


# --------------------------------------------------------------------------
# The RESULTS.md section
# --------------------------------------------------------------------------


def seed_spread(results: Sequence[StudyResult], test_set: str) -> Optional[float]:
    """Largest minus smallest WER on ``test_set`` among ``results`` (runs of one setting, other seeds)."""
    values = [r.wers[test_set] for r in results if test_set in r.wers]
    return max(values) - min(values) if len(values) > 1 else None


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def format_table(results: Sequence[StudyResult]) -> str:
    """Markdown table, one row per arm, in the given order."""
    lines = [
        "| arm | change from the defaults | params | steps | train min | wall min | simple < 0.5 at step "
        "| train loss | valid loss | test-clean WER | test-other WER |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        landmark = "never" if r.simple_below_target_step is None else str(r.simple_below_target_step)
        lines.append(
            f"| {r.name} | {r.change} | {r.num_parameters / 1e6:.2f} M | {r.steps} | {_minutes(r.train_seconds)} "
            f"| {_minutes(r.wall_seconds)} | {landmark} | {r.train_loss:.4f} | {r.valid_loss:.4f} "
            f"| {r.wers.get('test-clean', float('nan')):.2f} | {r.wers.get('test-other', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def mean_wer(results: Sequence[StudyResult], test_set: str) -> float:
    return statistics.fmean(r.wers[test_set] for r in results)


def compare_to_baseline(
    results: Sequence[StudyResult], baselines: Sequence[StudyResult]
) -> List[Tuple[str, float, float, bool]]:
    """Per arm: (name, test-clean WER minus the baselines' mean, same for test-other, beyond the seed spread).

    A difference counts as beyond the spread when both test sets differ from
    the baseline mean by more than the baseline runs differ from each other.
    """
    base_names = {b.name for b in baselines}
    spread = {t: seed_spread(baselines, t) or 0.0 for t in TEST_SETS}
    means = {t: mean_wer(baselines, t) for t in TEST_SETS}
    rows = []
    for r in results:
        if r.name in base_names:
            continue
        deltas = [r.wers[t] - means[t] for t in TEST_SETS]
        rows.append((r.name, deltas[0], deltas[1], all(abs(d) > spread[t] for d, t in zip(deltas, TEST_SETS))))
    return rows


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


def render_section(args: argparse.Namespace, results: Sequence[StudyResult], recipe_dir: Path) -> str:
    """The "Learning speed" section of RESULTS.md (commands shown from ``recipe_dir``)."""
    base = [r for r in results if r.name.startswith("baseline")]
    lines = [
        "## Learning speed",
        "",
        f"Written by `./{SECTION.writer}` on {today()} "
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
    work_dir = shown_work_dir(args.work_dir, recipe_dir)
    lines += [
        f"Commands (from egs/librispeech/ASR, after `bash prepare.sh --size small --work-dir {work_dir}`; "
        f"the study runs train.py and decode.py in `{work_dir}`):",
        "",
        "```",
        f"./{SECTION.writer} --work-dir {work_dir} --minutes {args.minutes:g}",
        "# which runs, per arm:",
        commands_block(args, results),
        "```",
    ]
    return "\n".join(lines)


def shown_work_dir(work_dir: Path, recipe_dir: Path) -> str:
    """``work_dir`` relative to the recipe folder when inside it, else as given."""
    try:
        return str(Path(work_dir).resolve().relative_to(recipe_dir.resolve())) or "."
    except ValueError:
        return str(work_dir)
