"""Read the scalars a training script writes to ``<exp-dir>/tensorboard``.

The tag names have one home, :data:`icefall_lite.train.tb_tags.TB_TAGS`,
which the training loop writes with and the readers read with.

A resumed run writes a new event file starting at the resume step (train.py
opens its SummaryWriter with ``purge_step``); TensorBoard's EventAccumulator
drops the superseded points, so every step appears once, with the value of
the run that went on from it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

Series = List[Tuple[int, float]]


def seven_digits(v: float) -> float:
    """``v`` to 7 significant digits, as the run summaries keep TensorBoard's float32 scalars: the same value
    read again compares equal; two float32 neighbours may too (round-tripping one needs 9), so a comparison at
    these digits is close, not bit for bit."""
    return float(f"{v:.7g}")


def read_scalars(log_dir: Path, tags: Optional[Sequence[str]] = None) -> Dict[str, Series]:
    """``{tag: [(step, value), ...]}`` sorted by step, for ``tags`` (all scalar tags if None).

    Raises:
      FileNotFoundError: ``log_dir`` holds no event file.
    """
    log_dir = Path(log_dir)
    if not any(log_dir.glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"no TensorBoard event files in {log_dir}; was train.py run with --tensorboard true?")
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    available = acc.Tags().get("scalars", [])
    wanted = available if tags is None else [t for t in tags if t in available]
    out: Dict[str, Series] = {}
    for tag in wanted:
        by_step = {int(e.step): float(e.value) for e in acc.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    logging.debug(f"{log_dir}: {len(out)} scalar tags")
    return out


def values(series: Series) -> List[float]:
    """The finite values of a series."""
    return [v for _, v in series if math.isfinite(v)]


def moving_average(series: Series, window: int) -> Series:
    """Trailing mean over ``window`` points (non-finite values skipped)."""
    out: Series = []
    kept: List[float] = []
    for step, value in series:
        if math.isfinite(value):
            kept.append(value)
        recent = kept[-window:]
        if recent:
            out.append((step, sum(recent) / len(recent)))
    return out
