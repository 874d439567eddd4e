"""The ablation's resolved settings (:class:`Settings`: the round, the conditions and their data, the arms,
the plan, the paths), the files that mark a run's state, and the check that a rerun keeps the settings its
summaries were made with."""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Tuple

from studies.ablation.arms import Arm, Condition, Plan, Thresholds, same_controls
from studies.ablation.family import StudyConfig
from studies.ablation.runs import (
    read_summary,
    stored_runs,
)
from studies.runner import (
    StudyError,
    read_json,
    write_json_atomic,
)

CONFIG_FILE = "ablation-config.json"


ARM_FILE = "ablation-arm.json"  # in every run dir: the arm's train.py flags


TRAINED_MARKER = "ablation-trained.json"  # in every run dir once train.py has finished (validation included)


MACHINE_FILE = "ablation-machine.json"  # in every run dir: the machine of every train.py invocation


OBSERVING_ARM = "none"


FILTER_ARM = "grad-filter-threshold"


PILOT = "pilot"  # <exp-root>/pilot/..., <summaries>/pilot/...


VERIFY_DIR = "verify-cpu"  # <exp-root>/verify-cpu/...: retrainings of another CPU's runs, removed when checked


class Keyed(Protocol):
    """A run's or a replay's key: where its folder is, relative to the runs' root."""

    @property
    def relpath(self) -> str: ...


@dataclass
class Settings:
    """Resolved flags: the round's configuration, the conditions (with any budget override), their data folders
    and BPE models, the arms, the plan, the replays, the paths (``recipe_dir``: where the recipe's scripts are;
    ``summaries``: the run summaries of the round)."""

    args: argparse.Namespace
    config: StudyConfig
    recipe_dir: Path
    conditions: Dict[str, Condition]
    work_dirs: Dict[str, Path]
    bpe_models: Dict[str, Path]
    exp_root: Path
    results_dir: Path
    summaries: Path
    thresholds: Thresholds
    arms: Dict[str, Arm]
    plan: Plan
    replay_events: int
    replays_per_seed: int
    model_args: List[str]

    @property
    def methods(self) -> List[str]:
        return list(dict.fromkeys(self.args.decoding_methods))

    @property
    def save_every_n(self) -> int:
        return self.args.save_every_n

    @property
    def avg(self) -> int:
        return self.args.avg

    def decode_points(self, steps: int) -> List[int]:
        """Where a run of ``steps`` is decoded: a third, two thirds and the whole budget, each rounded to a
        checkpoint step; a point with fewer than ``avg`` checkpoints before it (icefall's averaging needs
        them) is dropped, the budget itself kept. The points are multiples of the average period as well,
        so that icefall's average between two checkpoints is exact (ablation.py checks the budget and
        ``avg x save_every_n``)."""
        unit = math.lcm(self.save_every_n, self.args.average_period)
        points = []
        for k in (1, 2, 3):
            point = round(steps * k / 3 / unit) * unit if k < 3 else steps
            if point == steps or point >= (self.avg + 1) * self.save_every_n:
                points.append(point)
        return sorted(set(points))

    def points_of(self, condition: str, steps: Optional[int] = None) -> List[int]:
        """Where a run of ``condition`` trained to ``steps`` (default: its budget) is decoded: its family.json
        budget's points at that budget, else (a budget set by ``--steps``) :meth:`decode_points`."""
        budget = self.config.budget_of(condition)
        steps = self.conditions[condition].steps if steps is None else steps
        return list(budget.decode_at) if steps == budget.steps else self.decode_points(steps)

    def decoding_of(self, point: int) -> Tuple[int, int, bool]:
        """``(iteration, avg, use_averaged_model)`` of the decoding at ``point``: icefall's averaged model over
        the ``avg`` checkpoints before it when there are that many, else the checkpoint alone."""
        if point >= (self.avg + 1) * self.save_every_n:
            return point, self.avg, True
        return point, 1, False

    def rel(self, path: Path, condition: str) -> str:
        """``path`` relative to the condition's data folder (where the commands run)."""
        return os.path.relpath(path.resolve(), self.work_dirs[condition])

    def run_dir(self, key: Keyed) -> Path:
        """The folder of a run or a replay (``key``: a RunKey or a ReplayKey) in ``exp_root``."""
        return self.exp_root / key.relpath

    def replays_on(self, condition: str) -> bool:
        return self.replay_events > 0 and {OBSERVING_ARM, FILTER_ARM} <= {a.name for a in self.plan.arms}

    def stored_config(self) -> Dict:
        """What must not change between reruns into the same results."""
        return {
            "round": self.config.round,
            "conditions": {
                name: {
                    "steps": c.steps,
                    "max_duration": c.max_duration,
                    "flags": c.all_train_flags(),
                    "bpe_model": self.rel(self.bpe_models[name], name),
                }
                for name, c in self.conditions.items()
            },
            "model_args": self.model_args,
            "replay_steps": self.args.replay_steps,
            "save_every_n": self.save_every_n,
            "avg": self.avg,
            "average_period": self.args.average_period,
        }


def find_bpe_model(work_dir: Path) -> Path:
    """The single ``data/lang_bpe_*/bpe.model`` under ``work_dir``."""
    found = sorted((work_dir / "data").glob("lang_bpe_*/bpe.model"))
    if len(found) != 1:
        what = ", ".join(str(p) for p in found) if found else "none"
        raise StudyError(f"expected one data/lang_bpe_*/bpe.model in {work_dir} (found: {what})")
    return found[0]


def stored_bpe_model(summaries: Path, condition: str, work_dir: Path) -> Path:
    """The BPE model the condition's summaries were made with (their stored settings), in ``work_dir``."""
    stored = read_json(summaries / CONFIG_FILE) or {}
    relpath = stored.get("conditions", {}).get(condition, {}).get("bpe_model")
    if relpath is None:
        raise StudyError(f"{summaries / CONFIG_FILE} has no BPE model for condition {condition}")
    return work_dir / relpath


def _grew(s: Settings, condition: str, old: Dict, new: Dict) -> bool:
    """Whether ``condition``'s stored settings ``old`` differ from ``new`` only by a longer budget whose
    decoding points begin with those of every run made before (they keep only their last checkpoints, so an
    earlier point they were not decoded at could not be decoded now)."""
    if not old["steps"] < new["steps"] or {**old, "steps": new["steps"]} != new:
        return False
    points = s.points_of(condition)
    for key in stored_runs(s.summaries, condition):
        made = read_summary(s.summaries, key)
        before = sorted(made.wer_at or [made.steps]) if made is not None else []
        if points[: len(before)] != before:
            return False
    return True


def check_config(s: Settings) -> None:
    """Store the settings on the first run; refuse a rerun with other settings for a condition already run
    (but a budget that grew and keeps the earlier decoding points: its finished runs train on from their last
    checkpoint), or with an arm whose controls differ from those its existing runs were trained with."""
    path = s.summaries / CONFIG_FILE
    wanted = s.stored_config()
    stored = read_json(path)
    if stored is not None:
        changed = {k: (stored.get(k), v) for k, v in wanted.items() if k != "conditions" and stored.get(k) != v}
        for name, c in wanted["conditions"].items():
            old = stored.get("conditions", {}).get(name)
            if old is not None and _grew(s, name, old, c):
                logging.info(f"condition {name}: the budget grew from {old['steps']} to {c['steps']} steps")
            elif old is not None and old != c:
                changed[f"condition {name}"] = (old, c)
        if changed:
            detail = "; ".join(f"{k}: was {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise StudyError(
                f"{s.summaries} was made with other settings ({detail}); use another --summaries or "
                "--results-dir, or remove it to start over"
            )
        wanted["conditions"] = {**stored.get("conditions", {}), **wanted["conditions"]}
    s.summaries.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, wanted)
    for name, arm in s.arms.items():
        for arm_file in sorted(s.exp_root.glob(f"*/{name}/seed-*/{ARM_FILE}")):
            trained = read_json(arm_file)["train_flags"]
            if not same_controls(trained, arm.train_flags()):
                raise StudyError(
                    f"{arm_file.parent} was trained with {shlex.join(trained)}, but arm {name} is now "
                    f"{shlex.join(arm.train_flags())}; give the arm's threshold it was run with, "
                    "or use another --exp-root"
                )


def with_budget(
    c: Condition, steps: Optional[int], max_duration: Optional[float], warm: Optional[int], base_lr: Optional[float]
) -> Condition:
    """The condition with any of its budget, batch size, warm-up and learning rate overridden."""
    train_flags = list(c.train_flags)
    if base_lr is not None:
        if "--base-lr" in train_flags:
            at = train_flags.index("--base-lr")
            del train_flags[at : at + 2]
        train_flags += ["--base-lr", f"{base_lr:g}"]
    return replace(
        c,
        steps=c.steps if steps is None else steps,
        max_duration=c.max_duration if max_duration is None else max_duration,
        model_warm_step=c.model_warm_step if warm is None else warm,
        train_flags=tuple(train_flags),
    )
