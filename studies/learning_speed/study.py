"""The learning-speed study's command line (``python -m studies.learning_speed``): which settings make the
default model learn fastest on 2 CPU cores.

Every arm trains the model from scratch for the same wall-clock budget (``train.py --max-minutes``,
validation not counted) with one change from the defaults of the time the study was set up (plus a second
seed of the baseline, and combinations), then decodes test-clean and test-other with greedy search using the
weights at the end of the budget (``--iter <last batch> --avg 1 --use-averaged-model false``). The budget is
wall-clock, not a number of steps, because the demo's budget is wall-clock and several levers (batch size,
model shape, vocabulary size, CTC head, tail padding) change what a step costs.

The study was run on the 3-hour corpus of that time, ``prepare.sh --size small``, kept in its own work dir so
that it does not clash with the default corpus in data/. From egs/librispeech/ASR:

  bash prepare.sh --size small --work-dir small-corpus
  python -m studies.learning_speed --work-dir small-corpus  # every arm
  python -m studies.learning_speed --arms baseline ctc      # some arms
  python -m studies.learning_speed --list                   # the arms

Resuming: a finished arm has <exp-root>/<arm>/learning-speed-done.json and is skipped; an arm cut off part-way
is started again from scratch (its budget is wall-clock, so a resumed arm would not be comparable). After every
arm the "Learning speed" section of studies/learning_speed/README.md is rewritten from all finished arms.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Optional, Sequence

from icefall_lite.utils import script_parser
from studies.learning_speed.arms import ARMS
from studies.learning_speed.report import README, SECTION, render_section
from studies.learning_speed.run import done_file, finished_results, run_arm
from studies.runner import RECIPE_DIR, Progress, StudyError

# Before the first arm is timed: its budget plus about 1.5 minutes of validation and decoding.
SETUP_MINUTES = 1.5


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(__doc__)
    parser.prog = "python -m studies.learning_speed"
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
        default=README,
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


def write_section(args: argparse.Namespace) -> None:
    SECTION.write(args.results_md, render_section(args, finished_results(args), RECIPE_DIR))


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s [learning_speed] %(message)s", level=logging.INFO)
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
    progress = Progress()
    for i, arm in enumerate(selected, 1):
        if done_file(args, arm).is_file():
            logging.info(f"[{i}/{len(selected)}] {arm.name}: done before, skipping")
            continue
        left = sum(1 for a in selected[i - 1 :] if not done_file(args, a).is_file())
        per_arm = progress.mean("arm", (args.minutes + SETUP_MINUTES) * 60)
        eta = progress.eta(left * per_arm)
        logging.info(f"[{i}/{len(selected)}] {arm.name} ({arm.change}); {eta} for the remaining arms")
        try:
            with progress.timing("arm"):
                result = run_arm(args, arm, RECIPE_DIR)
        except (StudyError, FileNotFoundError, KeyError) as e:
            logging.error(str(e))
            return 1
        logging.info(f"{arm.name}: {result.steps} steps, WER {result.wers}")
        write_section(args)
    write_section(args)
    return 0
