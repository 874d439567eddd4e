"""Whether this CPU computes as another: the newest seed of every arm another CPU made retrained here and
compared with its summary at every step (:mod:`studies.ablation.cpus`), the outcome recorded."""

from __future__ import annotations

import logging
import shutil
from typing import Dict, List, Optional, Tuple

from icefall_lite.train.tb_tags import TB_TAGS
from studies.ablation.cpus import (
    CPUS_FILE,
    Reproduction,
    first_difference,
    write_reproduction,
)
from studies.ablation.execute import (
    run,
    shown,
    train_command,
)
from studies.ablation.pairing import cpu_name
from studies.ablation.report.write import finished_results
from studies.ablation.runs import (
    EXACT_SCALARS,
    RunResult,
    kept_scalars,
)
from studies.ablation.settings import (
    VERIFY_DIR,
    Settings,
)
from studies.runner import (
    StudyError,
    machine_record,
    today,
)
from studies.tb_reader import read_scalars


def verify_cpu(s: Settings, steps: int) -> List[Reproduction]:
    """Retrain from scratch, on this CPU, the newest seed of every arm each other CPU made on each condition
    with this torch, ``steps`` steps each, and compare every step with its summary
    (:mod:`studies.ablation.cpus`); record the outcome per other CPU in ``<summaries>/cpus.json`` and return
    it. Runs made with another torch are not checked (logged with their count). The retrainings are removed
    afterwards."""
    machine = machine_record()
    here = cpu_name(machine)
    newest: Dict[str, Dict[Tuple[str, str], RunResult]] = {}
    other_torch = 0
    for result in finished_results(s):
        name = cpu_name(result.machine)
        if name is None or name == here:
            continue
        if result.machine.get("torch") != machine["torch"]:
            other_torch += 1
            continue
        newest.setdefault(name, {})[(result.key.condition, result.key.arm)] = result  # seeds ascend
    if other_torch:
        logging.warning(f"{other_torch} run(s) made with another torch than this one ({machine['torch']}): not checked")
    if not newest:
        raise StudyError(
            f"no run in {s.summaries} was made on another CPU with torch {machine['torch']}: nothing to verify"
        )
    out = []
    for other, runs in sorted(newest.items()):
        outcome: Dict[str, Optional[int]] = {}
        commands: List[str] = []
        for original in runs.values():
            exp_dir = s.exp_root / VERIFY_DIR / original.key.relpath
            shutil.rmtree(exp_dir, ignore_errors=True)  # from scratch: a checkpoint left would be resumed
            cmd = train_command(s, original.key, exp_dir=exp_dir, max_batches=steps, save_every_n=0)
            commands.append(shown(s, original.key.condition, cmd))
            run(s, original.key.condition, cmd, f"{original.key.relpath}: retraining {steps} steps", exp_dir)
            scalars, _ = kept_scalars(read_scalars(exp_dir / "tensorboard"), TB_TAGS, extra=EXACT_SCALARS)
            step = outcome[original.key.relpath] = first_difference(original, scalars, steps)
            logging.info(
                f"{original.key.relpath} (made on {other}): "
                + (f"every one of {steps} steps reproduced" if step is None else f"parts at step {step}")
            )
        reproduction = Reproduction(here, other, steps, outcome, today(), commands, machine["torch"])
        write_reproduction(s.summaries, reproduction)
        shutil.rmtree(s.exp_root / VERIFY_DIR, ignore_errors=True)
        logging.info(
            f"{here} {'reproduced' if reproduction.reproduced else 'did not reproduce'} {other}'s runs "
            f"({len(outcome)} runs, {steps} steps each): recorded in {s.summaries / CPUS_FILE}"
        )
        out.append(reproduction)
    return out
