"""The pilot's runs (``pilot.json``): the ``none`` arm on every cell of the grid, seed by seed, each trained,
decoded and kept as a small summary (``summaries/pilot/<cell>/seed-<n>.json``); resumable at every step
(a finished training leaves a marker, a finished decoding its wer-summary, a finished run its summary)."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from icefall_lite.data.corrupt import INFO_FILE
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.train.sequence_log import FILE as SEQUENCE_FILE
from icefall_lite.train.sequence_log import read_sequence_log
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import remove_path
from studies.regime.grid import BPE_MODEL, CELLS, CORPUS_DIR, CORRUPTIONS, PREPARE, Cell, arm_flags
from studies.runner import (
    RECIPE_DIR,
    Progress,
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
DESIGN: Dict = json.loads((HERE / "pilot.json").read_text())
SUMMARIES = HERE / "summaries" / "pilot"
CORPUS = RECIPE_DIR / CORPUS_DIR
EXP_ROOT = RECIPE_DIR / "lstm_transducer_stateless" / "exp-regime" / "pilot"
TRAINED = "regime-trained.json"  # in a run folder once train.py has finished: its machine and wall time
SCRIPTS = "../lstm_transducer_stateless"  # the recipe's scripts, from the corpus folder
WINDOW = 50  # steps per point of a summary's loss curve


def run_dir(cell: Cell, seed: int) -> Path:
    return EXP_ROOT / cell.name / f"seed-{seed}"


def summary_path(cell: Cell, seed: int) -> Path:
    return SUMMARIES / cell.name / f"seed-{seed}.json"


def decoding() -> Tuple[int, int, bool]:
    d = DESIGN["decode"]
    return d["at"], d["avg"], d["use_averaged_model"]


def train_command(cell: Cell, seed: int) -> List[str]:
    d = DESIGN["decode"]
    return [
        "python",
        f"{SCRIPTS}/train.py",
        "--exp-dir",
        os.path.relpath(run_dir(cell, seed), CORPUS),
        "--bpe-model",
        BPE_MODEL,
        "--num-epochs",
        "100",
        "--max-batches",
        str(DESIGN["steps"]),
        "--seed",
        str(seed),
        "--num-workers",
        "0",
        "--save-every-n",
        str(d["save_every_n"]),
        "--keep-last-k",
        "0",
        "--average-period",
        str(d["average_period"]),
        *arm_flags(DESIGN["arm"]),
        *cell.train_flags(),
        "--log-sequence-gradients",
        "true",
    ]


def decode_command(cell: Cell, seed: int) -> List[str]:
    at = decoding()
    return [
        "python",
        f"{SCRIPTS}/decode.py",
        "--exp-dir",
        os.path.relpath(run_dir(cell, seed), CORPUS),
        "--bpe-model",
        BPE_MODEL,
        *decode_flags(at[0], DESIGN["decode"]["method"], at[1], at[2]),
        "--num-workers",
        "0",
        *cell.setting.model_flags,
    ]


def shown(cmd: List[str]) -> str:
    """A command as typed from the recipe folder."""
    return f"(cd {CORPUS_DIR} && {' '.join(cmd)})"


def prepare() -> None:
    """The regime corpus and its corrupted training sets (each step skips what is done)."""
    run_command(list(PREPARE), RECIPE_DIR, "the regime corpus")
    for corruption in CORRUPTIONS:
        if corruption.fraction > 0:
            run_command(corruption.command(), CORPUS, f"the {corruption.name} training set")


def _windows(series: List[Tuple[int, float]]) -> List[Optional[float]]:
    """Mean of each ``WINDOW`` steps (None where a window has no finite value), 4 significant digits."""
    out: Dict[int, List[float]] = {}
    for step, value in series:
        out.setdefault(step // WINDOW, [])
        if math.isfinite(value):
            out[step // WINDOW].append(value)
    return [float(f"{statistics.fmean(v):.4g}") if v else None for _, v in sorted(out.items())]


def corrupted_kinds(cell: Cell) -> Dict[str, str]:
    """``{cut id: kind}`` of the cell's corrupted training cuts (none for the clean set)."""
    if cell.corruption.fraction == 0:
        return {}
    info = json.loads((CORPUS / cell.corruption.manifest_dir / INFO_FILE).read_text())
    return {cut_id: d["kind"] for cut_id, d in info["cuts"].items()}


def sequence_counts(cell: Cell, seed: int) -> Optional[Dict]:
    """Per kind of training cut ("clean" or a corruption kind): how often it was in a batch, and how often its
    gradient RMS was above ``flag_at`` x the batch median in some layer (where the filter at that threshold
    acts on it); None for a run trained without --log-sequence-gradients."""
    path = run_dir(cell, seed) / SEQUENCE_FILE
    if not path.is_file():
        return None
    kinds = corrupted_kinds(cell)
    threshold = DESIGN["flag_at"]
    counts: Dict[str, Dict[str, int]] = {}
    for cuts, ratios in read_sequence_log(path).values():
        for i, cut_id in enumerate(cuts):
            c = counts.setdefault(kinds.get(cut_id, "clean"), {"occurrences": 0, "flagged": 0})
            c["occurrences"] += 1
            c["flagged"] += max(layer[i] for layer in ratios) > threshold
    return {"flag_at": threshold, "by_kind": dict(sorted(counts.items()))}


def summarise(cell: Cell, seed: int, trained: Dict, commands: List[str]) -> Dict:
    """What the report needs from one run: WERs, validation loss, skipped steps, the loss curve, the gradient
    norms and how far the observing filter saw single sequences' gradients above the batch median."""
    folder = run_dir(cell, seed)
    scalars = read_scalars(folder / "tensorboard")
    method = DESIGN["decode"]["method"]
    wers = read_wers(folder, [method], TEST_SETS, at=decoding())
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
    return {
        "key": {"cell": cell.name, "seed": seed},
        "steps": DESIGN["steps"],
        "wer": {t: wers[(method, t)] for t in TEST_SETS},
        "valid_loss": valid[-1][1] if valid else None,
        "skipped_steps": int(skipped[-1][1]) if skipped else 0,
        "loss_per_50_steps": _windows(scalars.get(TB_TAGS.loss, [])),
        "grad_norm": {"median": statistics.median(norms), "max": max(norms)} if norms else {},
        "max_over_median": {
            "max": max(ratios) if ratios else None,
            "steps_above_25": sum(r > 25 for r in ratios),
            "steps": len(ratios),
        },
        "sequences": sequence_counts(cell, seed),
        "machine": trained["machine"],
        "wall_s": trained["wall_s"],
        "commands": commands,
    }


def run_one(cell: Cell, seed: int) -> Dict:
    """Train, decode and summarise one run (each part skipped when done); its checkpoints removed after."""
    folder = run_dir(cell, seed)
    train, decode = train_command(cell, seed), decode_command(cell, seed)
    trained = read_json(folder / TRAINED)
    earlier = read_json(summary_path(cell, seed))  # a run made before the sequence log (pilot.json "sequences")
    if trained is not None and not (folder / SEQUENCE_FILE).is_file():
        trained = None
    if trained is None:
        remove_path(folder)  # a training cut short restarts: its partial folder would resume another way
        wall = run_command(train, CORPUS, f"train {cell.name} seed {seed}", shown=shown(train))
        trained = {"machine": machine_record(), "wall_s": {"train": round(wall, 1)}}
        write_json_atomic(folder / TRAINED, trained)
    if not decoded(folder, DESIGN["decode"]["method"], at=decoding()):
        wall = run_command(decode, CORPUS, f"decode {cell.name} seed {seed}", shown=shown(decode))
        trained["wall_s"]["decode"] = round(wall, 1)
        write_json_atomic(folder / TRAINED, trained)
    summary = summarise(cell, seed, trained, [shown(train), shown(decode)])
    if earlier is not None:
        summary["retrained"] = {"wer_before": earlier["wer"], "machine_before": earlier["machine"]}
        if earlier["wer"] != summary["wer"]:
            logging.warning(
                f"{cell.name} seed {seed}: retrained with the sequence log, WER {summary['wer']} "
                f"where it was {earlier['wer']}"
            )
    write_json_atomic(summary_path(cell, seed), summary)
    for checkpoint in folder.glob("*.pt"):
        checkpoint.unlink()
    return summary


def pending() -> List[Tuple[Cell, int]]:
    """The runs without a summary, in the pilot's order (seed by seed); then those whose summary has no
    sequence counts (made before the sequence log, pilot.json "sequences"), retrained."""
    runs = [(c, s) for s in DESIGN["seeds"] for c in CELLS]
    missing = [(c, s) for c, s in runs if not summary_path(c, s).is_file()]
    return missing + [
        (c, s) for c, s in runs if (c, s) not in missing and read_json(summary_path(c, s)).get("sequences") is None
    ]


def load_summaries() -> Dict[Tuple[str, int], Dict]:
    """Every finished run's summary, by ``(cell, seed)``."""
    out = {}
    for path in sorted(SUMMARIES.glob("*/seed-*.json")):
        s = json.loads(path.read_text())
        out[(s["key"]["cell"], s["key"]["seed"])] = s
    return out


def run_pilot(after_each=None) -> None:
    """Every pending run, in order; ``after_each()`` (the report) after each."""
    prepare()
    todo = pending()
    progress = Progress()
    for i, (cell, seed) in enumerate(todo):
        with progress.timing("run"):
            run_one(cell, seed)
        left = (len(todo) - i - 1) * progress.mean("run")
        logging.info(f"pilot: {i + 1} of {len(todo)} runs done ({progress.eta(left)})")
        if after_each is not None:
            after_each()
