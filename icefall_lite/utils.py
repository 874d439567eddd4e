"""Small helpers shared by the recipe scripts: AttributeDict, MetricsTracker, logging, str2bool."""

from __future__ import annotations

import argparse
import logging
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Dict, Union

import torch


class AttributeDict(dict):
    """A dict whose keys are also attributes (icefall's params object)."""

    def __getattr__(self, key):
        if key in self:
            return self[key]
        raise AttributeError(f"No such attribute '{key}'")

    def __setattr__(self, key, value):
        self[key] = value

    def __delattr__(self, key):
        if key in self:
            del self[key]
            return
        raise AttributeError(f"No such attribute '{key}'")

    def __str__(self) -> str:
        return "\n".join(f"  {k}: {v}" for k, v in self.items())


def str2bool(value: Union[str, bool]) -> bool:
    """argparse type for true/false flags (``--use-fp16 true``)."""
    if isinstance(value, bool):
        return value
    lowered = value.lower()
    if lowered in ("yes", "true", "t", "y", "1"):
        return True
    if lowered in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


class MetricsTracker(defaultdict):
    """Sums of loss terms and counts (``frames``, ``utterances``) that add and decay.

    Keys ending in ``loss`` are reported per frame.
    """

    def __init__(self) -> None:
        super().__init__(float)

    def __add__(self, other: "MetricsTracker") -> "MetricsTracker":
        out = MetricsTracker()
        for key in set(self) | set(other):
            out[key] = self.get(key, 0.0) + other.get(key, 0.0)
        return out

    def __mul__(self, alpha: float) -> "MetricsTracker":
        out = MetricsTracker()
        for key, value in self.items():
            out[key] = value * alpha
        return out

    def per_frame(self, key: str) -> float:
        frames = self.get("frames", 0.0)
        return self.get(key, 0.0) / frames if frames > 0 else float("nan")

    def per_frame_str(self) -> str:
        parts = [f"{k}={self.per_frame(k):.4g}" for k in sorted(self) if k.endswith("loss")]
        parts += [f"{k}={self[k]:.6g}" for k in sorted(self) if not k.endswith("loss")]
        return ", ".join(parts)

    def reduce(self, device: torch.device) -> None:
        """Sum over DDP ranks in place."""
        keys = sorted(self)
        values = torch.tensor([self[k] for k in keys], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(values)
        for k, v in zip(keys, values.tolist()):
            self[k] = v


def setup_logger(log_prefix: Union[str, Path], rank: int = 0, world_size: int = 1, level: int = logging.INFO) -> Path:
    """Log to ``<log_prefix>-<date>[-<rank>]`` and to the console (rank 0 only), icefall's format."""
    date = datetime.now().strftime("%Y-%m-%d-%H-%M-%S")
    log_file = Path(f"{log_prefix}-{date}" + (f"-{rank}" if world_size > 1 else ""))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fmt = "%(asctime)s %(levelname)s [%(filename)s:%(lineno)d]" + (f" ({rank}/{world_size})" if world_size > 1 else "") + " %(message)s"
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level)
    file_handler = logging.FileHandler(log_file, mode="w")
    file_handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(fmt))
        root.addHandler(console)
    return log_file
