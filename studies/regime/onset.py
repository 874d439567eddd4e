"""The regime study's confirmatory stage (``onset.json``, fixed before its runs): two questions, each run as a
:class:`studies.regime.stage.Stage`, in onset.json's order; and the machines their runs may come from.

- *slow-start*: does gradient control shorten the 12-layer model's slow start? (the plateau exit,
  :mod:`studies.regime.onset_stats`)
- *rescue*: where training without control collapses (``lr-x10.clean``), does a control save it? Its gate
  (``none``'s runs) comes first: the other arms run only where ``none`` collapsed in most of its runs.

A question's runs are compared only when made on one machine, its first run's, or on a machine that
:func:`verify_machine` showed to compute alike: it retrains that first run's first ``verify_steps`` steps and
compares the digest of their training loss with the one in the run's summary.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import remove_path
from studies.regime.family import diverged
from studies.regime.grid import CELL_BY_NAME
from studies.regime.stage import CORPUS, EXP_ROOT, HERE, SUMMARIES, Run, Stage, loss_digest, shown
from studies.runner import StudyError, code_commit, machine_record, run_command, today, write_json_atomic
from studies.tb_reader import read_scalars

DESIGN_FILE = HERE / "onset.json"
QUESTIONS = ("slow-start", "rescue")
Summaries = Dict[Tuple[str, str, int], Dict]


def load_design(path: Path = DESIGN_FILE) -> Optional[Dict]:
    """onset.json, None before it is written."""
    return json.loads(path.read_text()) if path.is_file() else None


def question_stage(name: str, design: Dict) -> Stage:
    """The stage of question ``name`` (a key of onset.json); its summaries keep the digest of the first
    ``verify_steps`` steps' training loss; a question without a plateau rule of its own takes slow-start's."""
    q = {**design[name], "verify_steps": design["verify_steps"]}
    q.setdefault("plateau", design["slow-start"]["plateau"])
    return Stage(name, q, (CELL_BY_NAME[q["cell"]],), tuple(q["arms"].items()))


def gate_runs(rescue: Stage) -> List[Run]:
    """rescue's gate: the baseline's runs, made before any other arm's."""
    return [r for r in rescue.runs() if r.arm == rescue.design["baseline"]]


def gate_passed(rescue: Stage, summaries: Summaries) -> Optional[bool]:
    """Whether the baseline collapsed in at least ``gate_min_collapsed`` of its runs; None before every gate run
    is in."""
    runs = [summaries.get((r.cell.name, r.arm, r.seed)) for r in gate_runs(rescue)]
    if any(s is None for s in runs):
        return None
    return sum(map(diverged, runs)) >= rescue.design["gate_min_collapsed"]


def run_all(design: Dict, after_each: Callable[[], object]) -> None:
    """onset.json's order as amended: slow-start seed by seed, rescue's gate, then (the gate passed) rescue's
    other arms. The gate is read from the runs the report counts (a gate run from a machine not shown alike
    leaves it undecided there, so the other arms wait as its answer does)."""
    slow, rescue = (question_stage(q, design) for q in QUESTIONS)
    for stage in (slow, rescue):
        check_here(stage)
    slow.run_all(after_each)
    rescue.run_all(after_each, only=gate_runs(rescue))
    if gate_passed(rescue, comparable(rescue, rescue.load_summaries())[0]):
        rescue.run_all(after_each)


def check_here(stage: Stage) -> None:
    """StudyError unless this checkout's code is the commit of the question's runs so far and this machine is
    their home or shown alike: a run made otherwise would be left out of its tests."""
    first = first_run(stage, stage.load_summaries())
    if first is None:
        return
    summary, here, commit = first[1], machine_name(machine_record()), code_commit()
    if summary["commit"] != commit:
        raise StudyError(
            f"{stage.name}'s runs were made with the code of commit {summary['commit']}; this checkout is {commit}. "
            f"Run the study from a worktree of that commit: {worktree_command(summary['commit'])}"
        )
    home = machine_name(summary["machine"])
    if here not in alike_machines(stage, home):
        raise StudyError(
            f"{stage.name}'s runs were made on {home}; this is {here}, not shown to compute alike, so its runs "
            "would be left out of the tests. Show it first: python -m studies.regime --verify-machine"
        )


# --------------------------------------------------------------------------
# One machine per question, or machines shown to compute alike
# --------------------------------------------------------------------------

MACHINES_FILE = "machines.json"  # in summaries/<question>/: the machines verify_machine showed to compute alike


def machine_name(record: Dict[str, str]) -> str:
    """A machine as the reports name it (studies.runner.machine_record's fields)."""
    return f"{record['cpu_model']} (flags {record['cpu_flags']}), {record['threads']} threads, torch {record['torch']}"


def first_run(stage: Stage, summaries: Summaries) -> Optional[Tuple[Run, Dict]]:
    """The question's first run in its design's order (for rescue: the gate's first) with its summary."""
    order = gate_runs(stage) + stage.runs() if stage.name == "rescue" else stage.runs()
    for run in order:
        s = summaries.get((run.cell.name, run.arm, run.seed))
        if s is not None:
            return run, s
    return None


def alike(stage: Stage) -> List[Dict]:
    """verify_machine's records of the question (each: ``machine``, ``of``, ``alike``, ``date``, ``command``)."""
    path = stage.summaries / MACHINES_FILE
    return json.loads(path.read_text())["verified"] if path.is_file() else []


def alike_machines(stage: Stage, home: str) -> Set[str]:
    """``home`` and every machine verify_machine showed to compute as it: either way round, or through another
    such machine (equal digests of one run's training losses are an equivalence)."""
    ok = {home}
    links = [(r["machine"], r["of"]) for r in alike(stage) if r["alike"]]
    while True:
        more = {m for pair in links if set(pair) & ok for m in pair} - ok
        if not more:
            return ok
        ok |= more


def comparable(stage: Stage, summaries: Summaries) -> Tuple[Summaries, int]:
    """The runs made on the question's home machine (its first run's) or on one shown to compute alike (either
    way round, or through another such machine), and the count of the others (left out of every test)."""
    first = first_run(stage, summaries)
    if first is None:
        return {}, 0
    ok = alike_machines(stage, machine_name(first[1]["machine"]))
    kept = {k: s for k, s in summaries.items() if machine_name(s["machine"]) in ok}
    return kept, len(summaries) - len(kept)


def worktree_command(commit: str) -> str:
    """The commands that run the study with the code of ``commit`` and this checkout's summaries."""
    return (
        f"git worktree add ../onset-wt {commit[:12]} && cd ../onset-wt && PYTHONPATH=. "
        f"REGIME_SUMMARIES={SUMMARIES} python -m studies.regime"
    )


def verify_machine(design: Dict) -> List[Dict]:
    """For each question whose first run was made on another machine than this one (and not yet shown alike
    here): retrain that run's first ``verify_steps`` steps here with its command, compare the digest of their
    training loss with its summary's and record the outcome in ``summaries/<question>/machines.json``. Returns
    the new records. The code must be the run's commit (a study's runs come from one commit: check it out in a
    worktree), else StudyError says which."""
    here, commit, out = machine_name(machine_record()), code_commit(), []
    for name in QUESTIONS:
        stage = question_stage(name, design)
        first = first_run(stage, stage.load_summaries())
        if first is None:
            continue
        run, summary = first
        home = machine_name(summary["machine"])
        if here in alike_machines(stage, home):
            logging.info(f"{name}: this machine is its home or shown alike already ({here})")
            continue
        if summary["commit"] != commit:
            raise StudyError(
                f"{name}'s first run was made with the code of commit {summary['commit']}, this checkout is "
                f"{commit}: verify from a worktree of that commit: {worktree_command(summary['commit'])} "
                "--verify-machine"
            )
        steps = design["verify_steps"]
        folder = EXP_ROOT / "verify-machine" / stage.relpath(run)
        remove_path(folder)
        cmd = _with_flags(stage.train_command(run), {"--exp-dir": os.path.relpath(folder, CORPUS)})
        cmd = _with_flags(cmd, {"--max-batches": str(steps)})
        run_command(cmd, CORPUS, f"{name}: retrain {stage.relpath(run)} for {steps} steps", shown=shown(cmd))
        digest = loss_digest(read_scalars(folder / "tensorboard").get(TB_TAGS.loss, []), steps)
        record = {
            "machine": here,
            "of": home,
            "alike": digest == summary["loss_digest"]["sha256"],
            "run": stage.relpath(run),
            "steps": steps,
            "date": today(),
            "command": shown(cmd),
        }
        logging.info(f"{name}: {here} {'computes' if record['alike'] else 'does not compute'} alike {home}")
        write_json_atomic(stage.summaries / MACHINES_FILE, {"verified": [*alike(stage), record]})
        remove_path(folder)
        out.append(record)
    return out


def _with_flags(cmd: List[str], values: Dict[str, str]) -> List[str]:
    """``cmd`` with the value after each flag of ``values`` replaced (each flag must be in it)."""
    out = list(cmd)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out
