"""The pilot (``pilot.json``, fixed before its runs): the ``none`` arm on every cell of the grid, 2 seeds,
600 steps; its report picks the cell of the study proper (:mod:`studies.regime.report`)."""

from __future__ import annotations

import json
from typing import Dict, List, Tuple

from studies.regime.grid import CELLS, Cell
from studies.regime.stage import HERE, Run, Stage, shown  # noqa: F401  (shown: the commands as the report gives them)

DESIGN: Dict = json.loads((HERE / "pilot.json").read_text())
PILOT = Stage("pilot", DESIGN, CELLS, ((DESIGN["arm"], DESIGN["arm"]),))
SUMMARIES = PILOT.summaries


def run(cell: Cell, seed: int) -> Run:
    return Run(cell, DESIGN["arm"], seed)


def train_command(cell: Cell, seed: int) -> List[str]:
    return PILOT.train_command(run(cell, seed))


def decode_command(cell: Cell, seed: int) -> List[str]:
    return PILOT.decode_command(run(cell, seed), PILOT.points[-1])


def load_summaries() -> Dict[Tuple[str, int], Dict]:
    """Every finished pilot run's summary, by ``(cell, seed)``."""
    return {(cell, seed): s for (cell, _, seed), s in PILOT.load_summaries().items()}
