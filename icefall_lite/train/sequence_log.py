"""Each sequence's gradient against its batch, step by step (``train.py --log-sequence-gradients``): which
utterances the GradientFilter saw as outliers, so that a study can match them with the ones it corrupted.

Per step, one JSON line in ``<exp-dir>/sequence-gradients.jsonl`` (``.rank<r>`` before ``.jsonl`` for rank r
of a multi-process run): the step, the batch's cut ids in batch order, and per encoder layer (the filters'
order) each sequence's gradient RMS over the batch median as the layer's filter measured it in backward
(:attr:`icefall_lite.nn.clip.GradientFilterStats.ratio`). The ratios stay device tensors until
:meth:`SequenceLog.flush` (at the log interval, with the TensorBoard scalars), which reads them with one
transfer. A resumed run appends the steps after its checkpoint again; :func:`read_sequence_log` keeps the
last record of each step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

FILE = "sequence-gradients.jsonl"


def log_path(exp_dir: Path, rank: int = 0, world_size: int = 1) -> Path:
    return exp_dir / (FILE if world_size == 1 else FILE.replace(".jsonl", f".rank{rank}.jsonl"))


class SequenceLog:
    """Pending ``(step, cut ids, per-layer ratio tensors)``, appended to ``path`` by :meth:`flush`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: List[Tuple[int, List[str], List[torch.Tensor]]] = []

    def add(self, step: int, cut_ids: Sequence[str], ratios: Sequence[torch.Tensor]) -> None:
        for layer, r in enumerate(ratios):
            if r.numel() != len(cut_ids):
                raise ValueError(f"step {step}: layer {layer} measured {r.numel()} sequences for {len(cut_ids)} cuts")
        self.pending.append((step, list(cut_ids), [r.detach() for r in ratios]))

    def flush(self) -> None:
        if not self.pending:
            return
        flat = torch.cat([r.reshape(-1).to(torch.float64).cpu() for _, _, rs in self.pending for r in rs]).tolist()
        lines, at = [], 0
        for step, ids, ratios in self.pending:
            layers = []
            for _ in ratios:
                layers.append([float(f"{x:.4g}") for x in flat[at : at + len(ids)]])
                at += len(ids)
            lines.append(json.dumps({"step": step, "cuts": ids, "ratio": layers}) + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(lines)
        self.pending = []


def read_sequence_log(path: Path) -> Dict[int, Tuple[List[str], List[List[float]]]]:
    """``{step: (cut ids, per-layer ratios)}``; of a step written twice (a resumed run), the last record."""
    out: Dict[int, Tuple[List[str], List[List[float]]]] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            out[record["step"]] = (record["cuts"], record["ratio"])
    return out
