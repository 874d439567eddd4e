"""The plan, made: every run seed by seed, each seed's replays after its runs, runs whose seed ran on
another CPU skipped, the time left estimated and the report rewritten after each."""

from __future__ import annotations

import logging
from typing import List

from studies.ablation.arms import RunKey
from studies.ablation.cpus import (
    computes_as,
)
from studies.ablation.execute import (
    kept_checkpoints,
    prune_run,
    run_done,
    run_one,
)
from studies.ablation.pairing import cpu_name, cpu_of
from studies.ablation.replay.result import (
    read_replay_summaries,
    read_replay_summary,
)
from studies.ablation.replay.run import redo_matched, replay_plan, run_replay, start_of
from studies.ablation.report.write import write_report
from studies.ablation.runs import (
    RunResult,
    read_summary,
    stored_runs,
)
from studies.ablation.settings import (
    OBSERVING_ARM,
    Settings,
)
from studies.runner import (
    Progress,
    machine_record,
)


def pairs_here(s: Settings, result: RunResult) -> bool:
    """Whether ``result`` counts as made on this CPU (its own, or one this CPU was shown to compute as, for
    its condition and this torch), or does not record its CPU."""
    machine = machine_record()
    here = cpu_name(machine)
    here_as = computes_as(s.summaries, result.key.condition, machine["torch"]).get(here, here)
    return cpu_of(result) in (None, here_as)


def runs_on_other_cpus(s: Settings, key: RunKey) -> List[str]:
    """The runs of ``key``'s condition and seed, in any arm, made on another CPU than this one (model, flags
    digest or threads) that this one has not been shown to compute as (:func:`verify_cpu`). Runs on two CPUs
    round differently and pair with none of each other's, so a run of ``key`` made here would count for
    nothing in their comparisons (its seed's runs are paired only with each other)."""
    found = []
    for made in stored_runs(s.summaries, key.condition):
        other = read_summary(s.summaries, made) if made.seed == key.seed else None
        if other is not None and not pairs_here(s, other):
            found.append(f"{made.arm} / seed-{key.seed} ({cpu_name(other.machine)})")
    return found


def run_plan(s: Settings, command: str) -> int:
    """Every run of the plan, seed by seed, each seed's replays after its runs (then its ``none`` run's
    checkpoints pruned); progress, an estimate of the time left, and the report after each. Returns the
    number of runs and replays made."""
    runs = s.plan.runs
    replays_total = s.replay_events if any(s.replays_on(c) for c in s.plan.conditions) else 0
    fraction = 5 * s.args.replay_steps / max(c.steps for c in s.conditions.values())
    # Runs finished earlier (a resumed plan) give the first estimate.
    earlier = [read_summary(s.summaries, k) for k in runs if run_done(s, k)]
    replayed = [
        r for c in s.plan.conditions for r in read_replay_summaries(s.summaries, c) if r.key.seed in s.plan.all_seeds
    ]
    progress = Progress(
        {
            "run": [r.wall_total_s for r in earlier if r.wall_s],
            "replay": [r.wall_total_s for r in replayed if r.wall_s],
        }
    )
    made, replays_done = 0, len(replayed)

    def log_left(i: int) -> None:
        runs_left = sum(1 for k in runs[i:] if not run_done(s, k) and k not in elsewhere)
        replays_left = max(0, replays_total - replays_done)
        per_run = progress.mean("run")
        left = runs_left * per_run + replays_left * progress.mean("replay", per_run * fraction)
        logging.info(f"{progress.eta(left)} for {runs_left} run(s) and {replays_left} replay(s)")

    elsewhere = {k: runs_on_other_cpus(s, k) for k in runs if not run_done(s, k)}
    elsewhere = {k: found for k, found in elsewhere.items() if found}
    for i, key in enumerate(runs, 1):
        if run_done(s, key):
            logging.info(f"[{i}/{len(runs)}] {key.relpath}: done earlier - skipped")
        elif key in elsewhere:
            logging.warning(
                f"[{i}/{len(runs)}] {key.relpath}: skipped, its seed's runs {'; '.join(elsewhere[key])} were made "
                f"on another CPU than this one ({cpu_name(machine_record())}), so it would pair with none of them; "
                "make it where they were made, or check first whether this CPU computes as theirs (--verify-cpu)"
            )
        else:
            logging.info(f"[{i}/{len(runs)}] {key.relpath} ({s.arms[key.arm].label}): starting")
            with progress.timing("run"):
                run_one(s, key)
            made += 1
            log_left(i)
            write_report(s, command)
        last_of_seed = i == len(runs) or runs[i].seed != key.seed
        if not last_of_seed:
            continue
        for condition in s.plan.conditions:
            if not s.replays_on(condition) or not run_done(s, RunKey(condition, OBSERVING_ARM, key.seed)):
                continue
            observed = read_summary(s.summaries, RunKey(condition, OBSERVING_ARM, key.seed))
            for rkey, event, matched in replay_plan(s, condition, key.seed):
                done = read_replay_summary(s.summaries, rkey)
                if done is not None and start_of(done.matched) == start_of(matched):
                    logging.info(f"{rkey.relpath}: done earlier - skipped")
                    continue
                if not pairs_here(s, observed):
                    logging.warning(
                        f"{rkey.relpath}: skipped, its run {observed.key.relpath} was made on another CPU "
                        f"({cpu_name(observed.machine)}), whose steps this one would not reproduce; make it there, "
                        "or check first whether this CPU computes as that one (--verify-cpu)"
                    )
                    continue
                if done is not None:
                    what = "made again" if matched is not None else "removed (no matched start now)"
                    logging.info(
                        f"{rkey.relpath}: done earlier with branch (d) from step {start_of(done.matched)}; the plan's "
                        f"matched start is now {start_of(matched)}: branch (d) and its reference {what}"
                    )
                    redo_matched(s, done, matched)
                    made += 1
                    write_report(s, command)
                    log_left(i)
                    continue
                logging.info(
                    f"{rkey.relpath}: replaying the event at step {event.step} (layer {event.layer}, "
                    f"{event.ratio:.1f}x the median); matched start {matched.start if matched else 'none found'}"
                )
                with progress.timing("replay"):
                    run_replay(s, rkey, event, matched)
                made += 1
                replays_done += 1
                write_report(s, command)
                log_left(i)
            steps = s.conditions[condition].steps
            none_dir = s.run_dir(RunKey(condition, OBSERVING_ARM, key.seed))
            prune_run(none_dir, kept_checkpoints(s, steps))
            retrained = none_dir.parent / f"seed-{key.seed}-retrained"
            if retrained.is_dir():
                prune_run(retrained, [])
    return made
