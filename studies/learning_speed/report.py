"""The learning-speed study's report: the per-arm table, the seed spread of the baseline and every arm against
it, and the commands, as the generated section of the study's README.md."""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from icefall_lite.decoding.constants import TEST_SETS
from studies.learning_speed.arms import ARMS, bpe_command, decode_command, train_command, vocab_size_of
from studies.learning_speed.run import StudyResult
from studies.runner import Section, today

# The study's own document: hand-written text around the section that every run of the study rewrites.
README = Path(__file__).resolve().parent / "README.md"
SECTION = Section("learning-speed", "python -m studies.learning_speed")


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
    """The "Learning speed" section of the study's README.md (commands shown from ``recipe_dir``)."""
    base = [r for r in results if r.name.startswith("baseline")]
    lines = [
        "## Learning speed",
        "",
        f"Written by `{SECTION.writer}` on {today()} "
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
        f"{SECTION.writer} --work-dir {work_dir} --minutes {args.minutes:g}",
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
