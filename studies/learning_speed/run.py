"""One arm of the learning-speed study run and read back: train.py and decode.py run from scratch, what the
last checkpoint records (steps, training seconds, losses, parameters), the wer-summary files, the simple-loss
landmark from TensorBoard, and the done file that says the arm has finished.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from icefall_lite.train.checkpoint import find_checkpoints, load_checkpoint_file
from icefall_lite.train.tb_tags import TB_TAGS, TrainingScalarTags
from icefall_lite.utils import write_text_atomic
from studies.learning_speed.arms import (
    ARMS,
    StudyArm,
    bpe_command,
    bpe_model_of,
    decode_command,
    train_command,
    vocab_size_of,
)
from studies.runner import read_wers, run_command
from studies.tb_reader import Series, moving_average, read_scalars

DONE_FILE = "learning-speed-done.json"
SIMPLE_LOSS_TARGET = 0.5  # per frame; the landmark of the warm-up
SIMPLE_LOSS_WINDOW = 20  # steps of the moving average


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
