"""A stage of the regime study (the pilot, the family): the runs its design file fixes, each trained, decoded
and kept as a small summary (``summaries/<stage>/<cell>[/<arm>]/seed-<n>.json``); resumable at every step (a
finished training leaves a marker, a finished decoding its wer-summary, a finished run its summary).

Every run is trained with ``--log-sequence-gradients`` (observational), and its summary counts, per kind of
training cut, how often a cut was in a batch and how often some layer saw its gradient above ``flag_at`` x
the batch median: where the filter at that threshold acts on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from icefall_lite.data.corrupt import INFO_FILE
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.sequence_log import FILE as SEQUENCE_FILE
from icefall_lite.train.sequence_log import read_sequence_log
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import remove_path
from studies.regime.grid import BPE_MODEL, CORPUS_DIR, CORRUPTIONS, PREPARE, Cell, arm_flags
from studies.runner import (
    RECIPE_DIR,
    Progress,
    StudyError,
    code_commit,
    decode_flags,
    decoded,
    machine_record,
    read_json,
    read_wers,
    run_command,
    write_json_atomic,
)
from studies.tb_reader import read_scalars

HERE = Path(__file__).resolve().parent
# Where the stages' run summaries are read and written: this folder's summaries/, or $REGIME_SUMMARIES. A study
# whose runs must all come from one commit runs from a worktree of that commit with REGIME_SUMMARIES pointing at
# the main checkout's summaries/, so that it resumes from every run committed there.
SUMMARIES = Path(os.environ.get("REGIME_SUMMARIES", HERE / "summaries"))
CORPUS = RECIPE_DIR / CORPUS_DIR
EXP_ROOT = RECIPE_DIR / "lstm_transducer_stateless" / "exp-regime"
TRAINED = "regime-trained.json"  # in a run folder once train.py has finished: its machine and wall time
SCRIPTS = "../lstm_transducer_stateless"  # the recipe's scripts, from the corpus folder
WINDOW = 50  # steps per point of a summary's loss curve


@dataclass(frozen=True)
class Run:
    cell: Cell
    arm: str
    seed: int


@dataclass(frozen=True)
class Stage:
    """A design file's runs: ``arms`` ({name: arm_flags spec}) on ``cells``, ``seeds`` each, ``steps`` steps,
    decoded at ``design["decode"]["at"]`` (a step or a list of steps; the last is the endpoint)."""

    name: str
    design: Dict
    cells: Tuple[Cell, ...]
    arms: Tuple[Tuple[str, str], ...]

    @property
    def seeds(self) -> List[int]:
        return list(self.design["seeds"])

    @property
    def steps(self) -> int:
        return int(self.design["steps"])

    @property
    def points(self) -> List[int]:
        at = self.design["decode"]["at"]
        return [at] if isinstance(at, int) else list(at)

    @property
    def method(self) -> str:
        return self.design["decode"]["method"]

    @property
    def summaries(self) -> Path:
        return SUMMARIES / self.name

    def decoding(self, point: int) -> Tuple[int, int, bool]:
        """``(iteration, avg, use_averaged_model)`` at ``point``."""
        d = self.design["decode"]
        return point, d["avg"], d["use_averaged_model"]

    def runs(self) -> List[Run]:
        """Seed by seed (a stage cut short has every cell and arm of its first seeds)."""
        return [Run(c, a, s) for s in self.seeds for c in self.cells for a, _ in self.arms]

    def relpath(self, run: Run) -> str:
        arm = f"{run.arm}/" if len(self.arms) > 1 else ""
        return f"{run.cell.name}/{arm}seed-{run.seed}"

    def run_dir(self, run: Run) -> Path:
        return EXP_ROOT / self.name / self.relpath(run)

    def summary_path(self, run: Run) -> Path:
        return self.summaries / f"{self.relpath(run)}.json"

    def train_command(self, run: Run) -> List[str]:
        d = self.design["decode"]
        return [
            "python",
            f"{SCRIPTS}/train.py",
            "--exp-dir",
            os.path.relpath(self.run_dir(run), CORPUS),
            "--bpe-model",
            BPE_MODEL,
            "--num-epochs",
            "100",
            "--max-batches",
            str(self.steps),
            "--seed",
            str(run.seed),
            "--num-workers",
            "0",
            "--save-every-n",
            str(d["save_every_n"]),
            "--keep-last-k",
            "0",
            "--average-period",
            str(d["average_period"]),
            *arm_flags(dict(self.arms)[run.arm]),
            *run.cell.train_flags(),
            "--log-sequence-gradients",
            "true",
        ]

    def decode_command(self, run: Run, point: int) -> List[str]:
        at = self.decoding(point)
        return [
            "python",
            f"{SCRIPTS}/decode.py",
            "--exp-dir",
            os.path.relpath(self.run_dir(run), CORPUS),
            "--bpe-model",
            BPE_MODEL,
            *decode_flags(at[0], self.method, at[1], at[2]),
            "--num-workers",
            "0",
            *run.cell.setting.model_flags,
        ]

    def sequence_counts(self, run: Run) -> Optional[Dict]:
        """Per kind of training cut ("clean" or a corruption kind): how often it was in a batch, and how often
        some layer saw its gradient RMS above ``flag_at`` x the batch median; None without a sequence log."""
        path = self.run_dir(run) / SEQUENCE_FILE
        if not path.is_file():
            return None
        kinds = corrupted_kinds(run.cell)
        threshold = self.design["flag_at"]
        counts: Dict[str, Dict[str, int]] = {}
        for cuts, ratios in read_sequence_log(path).values():
            for i, cut_id in enumerate(cuts):
                c = counts.setdefault(kinds.get(cut_id, "clean"), {"occurrences": 0, "flagged": 0})
                c["occurrences"] += 1
                c["flagged"] += max(layer[i] for layer in ratios) > threshold
        return {"flag_at": threshold, "by_kind": dict(sorted(counts.items()))}

    def summarise(self, run: Run, trained: Dict, commands: List[str]) -> Dict:
        """What the reports need from one run: WERs, validation loss, skipped steps, the loss curve, the
        gradient norms, the filter's view of single sequences and where the corrupted cuts' gradients went."""
        folder = self.run_dir(run)
        scalars = read_scalars(folder / "tensorboard")
        wers = {p: read_wers(folder, [self.method], TEST_SETS, at=self.decoding(p)) for p in self.points}
        norms = [v for _, v in scalars.get(TB_TAGS.grad_norm, []) if math.isfinite(v)]
        ratio_by_step: Dict[int, float] = {}
        for tag, series in scalars.items():
            parsed = TB_TAGS.parse_filter_tag(tag)
            if parsed is not None and parsed[1] == "max_over_median":
                for step, value in series:
                    ratio_by_step[step] = max(ratio_by_step.get(step, 0.0), value)
        ratios = list(ratio_by_step.values())
        valid = scalars.get(TB_TAGS.valid_loss, [])
        skipped = scalars.get(TB_TAGS.skipped_steps, [])
        key = {"cell": run.cell.name, "seed": run.seed}
        if len(self.arms) > 1:
            key = {"cell": run.cell.name, "arm": run.arm, "seed": run.seed}
        end = self.points[-1]
        summary = {
            "key": key,
            "steps": self.steps,
            "wer": {t: wers[end][(self.method, t)] for t in TEST_SETS},
        }
        if len(self.points) > 1:
            summary["wer_at"] = {str(p): {t: wers[p][(self.method, t)] for t in TEST_SETS} for p in self.points}
        return {
            **summary,
            "valid_loss": valid[-1][1] if valid else None,
            "skipped_steps": int(skipped[-1][1]) if skipped else 0,
            "loss_per_50_steps": _windows(scalars.get(TB_TAGS.loss, [])),
            "grad_norm": {"median": statistics.median(norms), "max": max(norms)} if norms else {},
            "max_over_median": {
                "max": max(ratios) if ratios else None,
                "steps_above_25": sum(r > 25 for r in ratios),
                "steps": len(ratios),
            },
            "sequences": self.sequence_counts(run),
            **self.reproduction(scalars),
            "machine": trained["machine"],
            "wall_s": trained["wall_s"],
            "commands": commands,
        }

    def reproduction(self, scalars: Dict[str, List[Tuple[int, float]]]) -> Dict:
        """Where the design asks for it (``verify_steps``): the commit of the code that made the run and the
        digest of its first ``verify_steps`` steps' training loss (:func:`loss_digest`), with which another
        machine is shown to compute alike by retraining those steps; else {}."""
        steps = self.design.get("verify_steps")
        if steps is None:
            return {}
        digest = loss_digest(scalars.get(TB_TAGS.loss, []), steps)
        return {"commit": code_commit(), "loss_digest": {"steps": steps, "sha256": digest}}

    def run_one(self, run: Run) -> Dict:
        """Train, decode and summarise one run (each part skipped when done); its checkpoints removed after.
        A run trained before the sequence log is trained again (with it), its earlier WER kept beside."""
        folder = self.run_dir(run)
        train = self.train_command(run)
        decodes = [self.decode_command(run, p) for p in self.points]
        trained = read_json(folder / TRAINED)
        earlier = read_json(self.summary_path(run))
        if trained is not None and not (folder / SEQUENCE_FILE).is_file():
            trained = None
        what = f"{run.cell.name} {run.arm} seed {run.seed}"
        if trained is None:
            remove_path(folder)  # a training cut short restarts: its partial folder would resume another way
            wall = run_command(train, CORPUS, f"train {what}", shown=shown(train))
            trained = {"machine": machine_record(), "wall_s": {"train": round(wall, 1)}}
            write_json_atomic(folder / TRAINED, trained)
        for point, decode in zip(self.points, decodes):
            if not decoded(folder, self.method, at=self.decoding(point)):
                wall = run_command(decode, CORPUS, f"decode {what} at {point}", shown=shown(decode))
                trained["wall_s"][f"decode-{point}" if len(self.points) > 1 else "decode"] = round(wall, 1)
                write_json_atomic(folder / TRAINED, trained)
        summary = self.summarise(run, trained, [shown(train), *(shown(d) for d in decodes)])
        if earlier is not None:
            summary["retrained"] = {"wer_before": earlier["wer"], "machine_before": earlier["machine"]}
            if earlier["wer"] != summary["wer"]:
                logging.warning(f"{what}: retrained with the sequence log, WER {summary['wer']}, was {earlier['wer']}")
        write_json_atomic(self.summary_path(run), summary)
        for checkpoint in folder.glob("*.pt"):
            checkpoint.unlink()
        return summary

    def pending(self) -> List[Run]:
        """The runs without a summary, in order; then those whose summary has no sequence counts (made before
        the sequence log), to be trained again."""
        runs = self.runs()
        missing = [r for r in runs if not self.summary_path(r).is_file()]
        again = [r for r in runs if r not in missing and read_json(self.summary_path(r)).get("sequences") is None]
        return missing + again

    def load_summaries(self) -> Dict[Tuple[str, str, int], Dict]:
        """Every finished run's summary, by ``(cell, arm, seed)``."""
        out = {}
        for run in self.runs():
            summary = read_json(self.summary_path(run))
            if summary is not None:
                out[(run.cell.name, run.arm, run.seed)] = summary
        return out

    def run_all(self, after_each: Optional[Callable[[], object]] = None, only: Optional[List[Run]] = None) -> None:
        """Every pending run (of ``only``, where given), in order; ``after_each()`` (the report) after each."""
        prepare()
        todo = [r for r in self.pending() if only is None or r in only]
        progress = Progress()
        failed = []
        for i, run in enumerate(todo):
            try:
                with progress.timing("run"):
                    self.run_one(run)
            except StudyError as e:  # the others still run; this one stays pending, for the next invocation
                logging.error(f"{self.name}: {e}")
                failed.append(run)
            left = (len(todo) - i - 1) * progress.mean("run", default=0.0)
            logging.info(f"{self.name}: {i + 1} of {len(todo)} runs done ({progress.eta(left)})")
            if after_each is not None:
                after_each()
        if failed:
            names = ", ".join(f"{r.cell.name} {r.arm} seed {r.seed}" for r in failed)
            raise StudyError(f"{self.name}: {len(failed)} runs failed ({names}); their logs are in their folders")


def shown(cmd: List[str]) -> str:
    """A command as typed from the recipe folder."""
    return f"(cd {CORPUS_DIR} && {' '.join(cmd)})"


def prepare() -> None:
    """The regime corpus and its corrupted training sets (each step skips what is done)."""
    run_command(list(PREPARE), RECIPE_DIR, "the regime corpus")
    for corruption in CORRUPTIONS:
        if corruption.fraction > 0:
            run_command(corruption.command(), CORPUS, f"the {corruption.name} training set")


def corrupted_kinds(cell: Cell) -> Dict[str, str]:
    """``{cut id: kind}`` of the cell's corrupted training cuts (none for the clean set)."""
    if cell.corruption.fraction == 0:
        return {}
    info = json.loads((CORPUS / cell.corruption.manifest_dir / INFO_FILE).read_text())
    return {cut_id: d["kind"] for cut_id, d in info["cuts"].items()}


def loss_digest(series: List[Tuple[int, float]], steps: int) -> str:
    """16 hex digits of the SHA-256 of the per-step training loss of the steps below ``steps`` (TensorBoard's
    float32 values, exactly): two machines compute alike over those steps when their digests agree."""
    values = [f"{step}:{value!r}" for step, value in series if step < steps]
    return hashlib.sha256(" ".join(values).encode()).hexdigest()[:16]


def _windows(series: List[Tuple[int, float]]) -> List[Optional[float]]:
    """Mean of each ``WINDOW`` steps (None where a window has no finite value), 4 significant digits."""
    out: Dict[int, List[float]] = {}
    for step, value in series:
        out.setdefault(step // WINDOW, [])
        if math.isfinite(value):
            out[step // WINDOW].append(value)
    return [float(f"{statistics.fmean(v):.4g}") if v else None for _, v in sorted(out.items())]
