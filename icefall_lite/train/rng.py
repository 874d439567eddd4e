"""Random state of a training run: seeding, and the states a checkpoint keeps so that a resumed
run draws what the uninterrupted one would have drawn.

Each owner saves and restores its own part: Python, NumPy, torch (and CUDA)
here; the data loader's cut transforms through
:func:`icefall_lite.data.datamodule.transform_rng_state`; the sampler's
position through lhotse's ``sampler.state_dict()`` (saved next to this in the
checkpoint).
"""

from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from icefall_lite.data.datamodule import set_transform_rng_state, transform_rng_state


def fix_random_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (every CUDA device too)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def get_rng_state(train_dl: Optional[DataLoader] = None) -> Dict[str, Any]:
    """The generators' states now, with those of ``train_dl``'s cut transforms when given."""
    return {
        "transforms": [] if train_dl is None else transform_rng_state(train_dl),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Dict[str, Any], train_dl: Optional[DataLoader] = None) -> None:
    """Restore what :func:`get_rng_state` returned (the transforms' states into ``train_dl``)."""
    if train_dl is not None:
        set_transform_rng_state(train_dl, state["transforms"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
