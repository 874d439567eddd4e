"""The ablation's command line (``python -m studies.ablation``, or the recipe's launcher
``lstm_transducer_stateless/ablation.py``): its flags (:func:`get_parser`; the manual is
:data:`~studies.ablation.report.how_to_run.HOW_TO_RUN`, its ``--help``), the flags resolved into
:class:`~studies.ablation.settings.Settings`, the command a report names, and :func:`main`."""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from icefall_lite.decoding.constants import DECODING_METHODS
from icefall_lite.train.rules import DESTS
from icefall_lite.utils import script_parser
from studies.ablation.arms import CONDITIONS, RUN_SETS, STUDY, Plan, Thresholds, make_arms, seeds_of, select
from studies.ablation.execute import pilot_conditions, run_done, run_pilot
from studies.ablation.plan import run_plan
from studies.ablation.report.depth import pilot_verdict
from studies.ablation.report.how_to_run import HOW_TO_RUN
from studies.ablation.report.write import REPORT, held_date_and_machine, write_report
from studies.ablation.runs import round_summaries
from studies.ablation.settings import Settings, check_config, find_bpe_model, stored_bpe_model, with_budget
from studies.ablation.verify import verify_cpu
from studies.runner import RECIPE_DIR, StudyError

STUDY_DIR = Path(__file__).resolve().parent  # studies/ablation: the report, its plots and the runs' summaries
DEFAULT_THRESHOLDS = Thresholds()
# The arms' thresholds: train.py's gradient controls (the registry), under train.py's names (ablation.py's flag ->
# Thresholds field). The relative clip takes several values (its sweep: the first is the arm of the plain name,
# clip-grad-norm-relative: 2x), so it is parsed apart.
THRESHOLD_FLAGS = tuple(dest for dest in DESTS if dest != "clip_grad_norm_relative")


def get_parser() -> argparse.ArgumentParser:
    parser = script_parser(HOW_TO_RUN)
    t = DEFAULT_THRESHOLDS
    add = parser.add_argument
    add("--set", choices=list(RUN_SETS), default="primary", help="which set of runs (see above)")
    add(
        "--pilot",
        choices=["auto", "only", "skip"],
        default="auto",
        help="the pilot of family.json (the budget check, on the round's and the deep condition): auto: before "
        "the primary and depth sets' runs, which go on only if the budget stands (or family.json says why it is "
        "kept); only: the pilot alone; skip: none",
    )
    add("--conditions", nargs="+", default=None, choices=list(CONDITIONS), help="conditions (default: the set's)")
    add("--arms", nargs="+", default=None, help="arms (default: the set's; --list shows the plan)")
    add("--num-seeds", type=int, default=None, help="seeds of every arm (default: the set's, per arm)")
    add("--seed", type=int, default=STUDY.first_seed, help="the first seed")
    add("--replay-events", type=int, default=None, help="replayed outlier events in all (default: the set's)")
    add("--replays-per-seed", type=int, default=None, help="at most this many per seed (default: the set's)")
    add("--replay-steps", type=int, default=STUDY.replay_window, help="steps of each branch of a replay")
    add("--steps", type=int, default=None, help="training steps of every run (default: the condition's)")
    add("--max-duration", type=float, default=None, help="seconds of audio per batch (default: the condition's)")
    add("--model-warm-step", type=int, default=None, help="train.py's --model-warm-step (default: the condition's)")
    add("--base-lr", type=float, default=None, help="train.py's --base-lr (default: the condition's)")
    add("--work-dir", type=Path, default=None, help="folder with data/ (prepare.sh --work-dir) for every condition")
    add(
        "--exp-root",
        type=Path,
        default=Path("lstm_transducer_stateless/exp-ablation"),
        help="where the runs go (<exp-root>/<condition>/<arm>/seed-<s>/); relative to the recipe folder",
    )
    add(
        "--results-dir",
        type=Path,
        default=STUDY_DIR,
        help="where the report (README.md), its plots (plots/) and the summaries go (default: studies/ablation)",
    )
    add(
        "--summaries",
        default=os.path.relpath(round_summaries(STUDY.summaries), STUDY_DIR),
        help="the run summaries' folder in --results-dir (default: the round's, summaries/round-<n>)",
    )
    add_threshold = parser.add_argument_group("thresholds of the arms (train.py's flags of those names)").add_argument
    for dest in THRESHOLD_FLAGS:  # each train.py rule's threshold, under its flag (the arm of that name)
        name = dest.replace("_", "-")
        add_threshold(
            f"--{name}", type=float, default=getattr(t, dest), help=f"arm {name}, and the arms joining it with +"
        )
    add_threshold(
        "--filter-sweep", type=float, nargs="*", default=list(t.filter_sweep), help="arms grad-filter-threshold-<t>"
    )
    add_threshold(
        "--guard-clip-grad-norm", type=float, default=t.guard, help="max norm of the guard, arm clip-grad-norm-<it>"
    )
    add_threshold(
        "--clip-grad-norm-relative",
        type=float,
        nargs="+",
        default=[t.clip_grad_norm_relative, *t.relative_sweep],
        help="multiples of the running median norm: arm clip-grad-norm-relative (the first), "
        "clip-grad-norm-relative-<x> (the others)",
    )
    add("--model-args", type=str, default="", help="model flags after the condition's (e.g. a tiny model to try)")
    add("--decoding-methods", nargs="+", choices=DECODING_METHODS, default=["greedy_search"], help="decoding")
    add("--num-workers", type=int, default=0, help="DataLoader workers (0: a resumed run reproduces exactly)")
    add("--save-every-n", type=int, default=STUDY.save_every_n, help="checkpoint every N steps (averaging, replays)")
    add("--avg", type=int, default=STUDY.avg, help="decode.py's --avg: checkpoints averaged over (icefall's)")
    add("--average-period", type=int, default=STUDY.average_period, help="train.py's: model_avg every N steps")
    add(
        "--verify-cpu",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead of the runs: retrain here, from scratch, the newest seed of every arm made on another CPU "
        "for STEPS steps, compare every step with its summary, and record in <summaries>/cpus.json whether this "
        "CPU computes as that one (then its runs pair with that CPU's)",
    )
    add("--list", action="store_true", help="print the runs of this invocation and exit")
    add(
        "--report-only",
        action="store_true",
        help="no run: write <results-dir>/README.md and its plots again from the summaries (a renderer or the "
        "hand-written provenance.md changed), keeping the report's date and machine",
    )
    return parser


def resolve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, need_data: bool = True) -> Settings:
    """The set's defaults filled in, the arms, the plan and the data folders; argparse errors for bad values.

    ``need_data=False`` (the report alone, from the summaries in --results-dir) neither needs the prepared
    data folders nor looks for their BPE models: the summaries' stored settings name them.
    """
    run_set = RUN_SETS[args.set]
    events = run_set.replay_events if args.replay_events is None else args.replay_events
    per_seed = run_set.replays_per_seed if args.replays_per_seed is None else args.replays_per_seed
    if min(args.replay_steps, args.save_every_n, args.avg, args.average_period) < 1 or min(events, per_seed) < 0:
        parser.error(
            "--replay-steps, --save-every-n, --avg and --average-period must be >= 1, "
            "--replay-events and --replays-per-seed >= 0"
        )
    if args.num_seeds is not None and args.num_seeds < 1:
        parser.error("--num-seeds must be >= 1")
    if any(x is not None and x <= 0 for x in (args.steps, args.max_duration, args.model_warm_step, args.base_lr)):
        parser.error("--steps, --max-duration, --model-warm-step and --base-lr must be positive")
    positive = {f"--{c.replace('_', '-')}": getattr(args, c) for c in THRESHOLD_FLAGS}
    positive["--guard-clip-grad-norm"] = args.guard_clip_grad_norm
    positive.update({f"--filter-sweep {x:g}": x for x in args.filter_sweep})
    positive.update({f"--clip-grad-norm-relative {x:g}": x for x in args.clip_grad_norm_relative})
    if args.autoclip_percentile > 100:
        parser.error(f"--autoclip-percentile {args.autoclip_percentile:g}: a percentile is at most 100")
    bad = [name for name, x in positive.items() if not 0 < x < float("inf")]
    if bad:
        parser.error(f"{', '.join(bad)}: thresholds must be positive and finite (the arms switch controls off)")
    relative = list(dict.fromkeys(args.clip_grad_norm_relative))
    thresholds = Thresholds(
        **{c: getattr(args, c) for c in THRESHOLD_FLAGS},
        filter_sweep=tuple(x for x in dict.fromkeys(args.filter_sweep) if x != args.grad_filter_threshold),
        clip_grad_norm_relative=relative[0],
        relative_sweep=tuple(relative[1:]),
        guard=args.guard_clip_grad_norm,
    )
    all_arms = make_arms(thresholds)
    try:
        names = select(args.arms or list(run_set.arms), [a.name for a in all_arms], "arm(s)")
    except ValueError as e:
        parser.error(str(e))
    arms = {a.name: a for a in all_arms}
    counts = dict(run_set.seeds_per_arm)
    seeds = {n: seeds_of(args.seed, args.num_seeds or counts.get(n, max(counts.values()))) for n in names}
    results_dir = args.results_dir.resolve()
    summaries = results_dir / args.summaries
    conditions, work_dirs, bpe_models = {}, {}, {}
    for name in dict.fromkeys(args.conditions or run_set.conditions):
        c = with_budget(CONDITIONS[name], args.steps, args.max_duration, args.model_warm_step, args.base_lr)
        work_dir = (args.work_dir or RECIPE_DIR / c.corpus_dir).resolve()
        if need_data and not (work_dir / "data" / "fbank").is_dir():
            parser.error(
                f"condition {name}: {work_dir} has no data/fbank; run (from the recipe) "
                f"{shlex.join(c.prepare_command())}, or pass --work-dir"
            )
        try:
            bpe_model = find_bpe_model(work_dir) if need_data else stored_bpe_model(summaries, name, work_dir)
        except StudyError as e:
            parser.error(f"condition {name}: {e}")
        bpe_models[name] = bpe_model.resolve()
        conditions[name], work_dirs[name] = c, work_dir
    plan = Plan(list(conditions), [arms[n] for n in names], seeds)
    window = args.avg * args.save_every_n  # the steps an averaged decoding spans
    unit = math.lcm(args.save_every_n, args.average_period)
    uneven = [f"{n}: {c.steps} steps" for n, c in conditions.items() if c.steps % unit]
    if window % args.average_period or uneven:
        parser.error(
            f"icefall's averaging between two checkpoints needs --avg x --save-every-n ({window}) a multiple of "
            f"--average-period ({args.average_period}) and the budget a multiple of both ({unit}): "
            + (", ".join(uneven) or "the window is not")
        )
    exp_root = args.exp_root if args.exp_root.is_absolute() else RECIPE_DIR / args.exp_root
    return Settings(
        args=args,
        config=STUDY,
        recipe_dir=RECIPE_DIR,
        conditions=conditions,
        work_dirs=work_dirs,
        bpe_models=bpe_models,
        exp_root=exp_root.resolve(),
        results_dir=results_dir,
        summaries=summaries,
        thresholds=thresholds,
        arms=arms,
        plan=plan,
        replay_events=events,
        replays_per_seed=per_seed,
        model_args=shlex.split(args.model_args),
    )


def invocation(argv: Sequence[str]) -> str:
    """This run's command line, as typed from the recipe dir."""
    return shlex.join(["./lstm_transducer_stateless/ablation.py", *argv])


def report_command(s: Settings, argv: Sequence[str]) -> str:
    """The commands that make the runs the report covers, whichever set writes it: ``argv`` without its --set
    (the primary set), then each other set that is running now or whose runs are in the summaries: secondary
    where `stress` has runs, depth where its condition has, landscape where its arms have runs on the round's
    condition."""
    base, skip = [], False
    for a in argv:
        if skip or a == "--set" or a.startswith("--set="):
            skip = a == "--set"
            continue
        base.append(a)
    has = {
        "secondary": (s.summaries / "stress").is_dir(),
        "depth": (s.summaries / STUDY.depth_condition).is_dir(),
        "landscape": any((s.summaries / STUDY.condition / c.arm).is_dir() for c in STUDY.landscape_family),
    }
    sets = [name for name, made in has.items() if made or s.args.set == name]
    return "\n".join([invocation(base), *(invocation([*base, "--set", name]) for name in sets)])


def list_plan(s: Settings) -> None:
    for key in s.plan.runs:
        state = "done" if run_done(s, key) else "to run"
        print(f"{key.relpath:32s} {state:7s} {s.arms[key.arm].label}")
    for c in s.plan.conditions:
        if s.replays_on(c):
            print(
                f"{c}: {s.replay_events} replays (at most {s.replays_per_seed} per seed) of "
                f"{s.args.replay_steps} steps, branches (a)-(e)"
            )


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = get_parser()
    args = parser.parse_args(argv)
    s = resolve_settings(parser, args, need_data=not args.report_only)
    if args.list:
        list_plan(s)
        return 0
    if args.report_only:
        held = held_date_and_machine(s.results_dir / REPORT) or (None, None)
        path = write_report(s, report_command(s, [a for a in argv if a != "--report-only"]), *held)
        print(path or f"no run summary at its budget in {s.summaries}: no report")
        return 0 if path else 1
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
        f"seeds {s.plan.all_seeds}; {s.replay_events} replay(s)"
    )
    try:
        check_config(s)
        if args.verify_cpu > 0:
            verify_cpu(s, args.verify_cpu)
            return 0
        if args.pilot == "only" or (args.pilot == "auto" and args.set in ("primary", "depth")):
            goes_on = []
            for c in pilot_conditions(s):
                stands, text = pilot_verdict(run_pilot(s, c), s.config)
                logging.info(f"Pilot on {c}: {text}")
                goes_on.append(bool(stands or s.config.budget_of(c).kept))  # kept: family.json says why
            if args.pilot == "only" or not all(goes_on):
                write_report(s, report_command(s, argv))
                return 0 if args.pilot == "only" else 1
        if run_plan(s, report_command(s, argv)) == 0:
            write_report(s, report_command(s, argv))
    except (StudyError, FileNotFoundError) as e:
        logging.error(str(e))
        return 1
    return 0
