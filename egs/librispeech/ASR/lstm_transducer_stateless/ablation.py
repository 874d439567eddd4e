#!/usr/bin/env python3
"""The gradient-control ablation: what do the GradientFilter, clip_grad_norm,
or both do to an LSTM transducer's training and its WER?

Every arm (studies/ablation/arms.py) trains the same model from scratch
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
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from icefall_lite.decoding.constants import DECODING_METHODS
from icefall_lite.utils import script_parser
from studies.ablation.arms import (
    CONDITIONS,
    CONTROLS,
    RUN_SETS,
    Plan,
    Thresholds,
    flag_of,
    make_arms,
    seeds_of,
    select,
)
from studies.ablation.study import (
    Settings,
    check_config,
    find_bpe_model,
    run_done,
    run_plan,
    stored_bpe_model,
    write_report,
)
from studies.runner import StudyError

RECIPE_DIR = Path(__file__).resolve().parents[1]
DEFAULT_THRESHOLDS = Thresholds()


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
    # The arms' thresholds: train.py's gradient-control flags, under train.py's names.
    add_threshold = parser.add_argument_group("thresholds of the arms (train.py's flags of those names)").add_argument
    add_threshold(
        "--grad-filter-threshold",
        type=float,
        default=t.grad_filter_threshold,
        help="GradientFilter threshold (arms filter, filter-clip)",
    )
    add_threshold(
        "--filter-sweep", type=float, nargs="*", default=list(t.filter_sweep), help="thresholds of arms filter-<t>"
    )
    add_threshold("--clip-grad-norm", type=float, default=t.clip_grad_norm, help="max norm of arms clip, filter-clip")
    add_threshold(
        "--clip-grad-norm-relative",
        type=float,
        default=t.clip_grad_norm_relative,
        help="arm clip-relative: clip_grad_norm at this multiple of the running median gradient norm",
    )
    add_threshold(
        "--agc-clipping", type=float, default=t.agc_clipping, help="lambda of the agc arm (unit-wise grad / weight)"
    )
    add_threshold(
        "--clip-grad-value", type=float, default=t.clip_grad_value, help="max |gradient element| of the value arm"
    )
    add_threshold("--error-clip", type=float, default=t.error_clip, help="max |layer-output grad| of arm error-clip")
    add("--model-args", type=str, default="", help="model flags after the condition's (e.g. a tiny model to try)")
    add("--decoding-methods", nargs="+", choices=DECODING_METHODS, default=["greedy_search"], help="decoding")
    add("--num-workers", type=int, default=0, help="DataLoader workers (0: a resumed run reproduces exactly)")
    add("--save-every-n", type=int, default=25, help="checkpoint every N steps (resuming; replay starts)")
    add("--list", action="store_true", help="print the runs of this invocation and exit")
    return parser


def resolve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, need_data: bool = True) -> Settings:
    """The set's defaults filled in, the arms, the plan and the data folders; argparse errors for bad values.

    ``need_data=False`` (the report alone, from the summaries in --results-dir) neither needs the prepared
    data folders nor looks for their BPE models: the summaries' stored settings name them.
    """
    run_set = RUN_SETS[args.set]
    num_seeds = run_set.num_seeds if args.num_seeds is None else args.num_seeds
    replays = run_set.replays_per_seed if args.replays_per_seed is None else args.replays_per_seed
    if num_seeds < 1 or replays < 0 or args.replay_steps < 1 or args.save_every_n < 1:
        parser.error("--num-seeds, --replay-steps and --save-every-n must be >= 1, --replays-per-seed >= 0")
    overrides = (args.steps, args.max_duration, args.model_warm_step)
    if any(x is not None and x <= 0 for x in overrides):
        parser.error("--steps, --max-duration and --model-warm-step must be positive")
    positive = {flag_of(c): getattr(args, c) for c in CONTROLS}
    positive.update({f"--filter-sweep {x:g}": x for x in args.filter_sweep})
    bad = [name for name, x in positive.items() if not 0 < x < float("inf")]
    if bad:
        parser.error(f"{', '.join(bad)}: thresholds must be positive and finite (the arms switch controls off)")
    sweep = tuple(x for x in dict.fromkeys(args.filter_sweep) if x != args.grad_filter_threshold)
    thresholds = Thresholds(**{c: getattr(args, c) for c in CONTROLS}, filter_sweep=sweep)
    all_arms = make_arms(thresholds)
    known = [a.name for a in all_arms]
    try:
        names = select(args.arms or list(run_set.arms), known, "arm(s)")
    except ValueError as e:
        parser.error(str(e))
    arms = {a.name: a for a in all_arms}
    condition_names = list(dict.fromkeys(args.conditions or run_set.conditions))
    results_dir = args.results_dir.resolve()
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
        if need_data and not (work_dir / "data" / "fbank").is_dir():
            parser.error(
                f"condition {name}: {work_dir} has no data/fbank; run (from the recipe) "
                f"{shlex.join(c.prepare_command())}, or pass --work-dir"
            )
        try:
            bpe_model = find_bpe_model(work_dir) if need_data else stored_bpe_model(results_dir, name, work_dir)
        except StudyError as e:
            parser.error(f"condition {name}: {e}")
        bpe_models[name] = bpe_model.resolve()
        conditions[name], work_dirs[name] = c, work_dir
    plan = Plan(condition_names, [arms[n] for n in names], seeds_of(args.seed, num_seeds))
    exp_root = args.exp_root if args.exp_root.is_absolute() else RECIPE_DIR / args.exp_root
    return Settings(
        args,
        RECIPE_DIR,
        conditions,
        work_dirs,
        bpe_models,
        exp_root.resolve(),
        results_dir,
        thresholds,
        arms,
        plan,
        replays,
        shlex.split(args.model_args),
    )


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
    except (StudyError, FileNotFoundError) as e:
        logging.error(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
