"""Continuing a run: which checkpoint to resume from, and restoring everything it holds."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from icefall_lite.train.checkpoint import (
    CheckpointError,
    find_checkpoints,
    load_checkpoint,
    load_checkpoint_file,
    load_state_dict_checked,
    remove_interrupted_saves,
    unwrap,
)
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.optim import Eden
from icefall_lite.utils import AttributeDict


def resume_checkpoint_path(params: AttributeDict) -> Optional[Path]:
    """The checkpoint to resume from: --start-batch / --start-epoch first, else the newest in exp-dir."""
    if params.start_batch > 0:
        return params.exp_dir / f"checkpoint-{params.start_batch}.pt"
    if params.start_epoch > 1:
        return params.exp_dir / f"epoch-{params.start_epoch - 1}.pt"
    candidates: List[Tuple[int, Path]] = []
    for path in list(params.exp_dir.glob("epoch-*.pt")) + find_checkpoints(params.exp_dir):
        try:
            candidates.append((int(load_checkpoint_file(path)["batch_idx_train"]), path))
        except (CheckpointError, KeyError) as e:
            logging.warning(f"Ignoring unusable checkpoint {path}: {e}")
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c[0], c[1].name.startswith("epoch-")))[1]


def init_from_weights(path: Path, model: nn.Module, model_avg: Optional[nn.Module]) -> None:
    """--init-from: ``model`` takes the ``model`` weights of checkpoint ``path`` (a clear error if they do not
    fit); ``model_avg`` starts as their float64 copy, as a fresh run's starts as the initial weights."""
    checkpoint = load_checkpoint_file(path)
    load_state_dict_checked(unwrap(model), checkpoint["model"], f"--init-from {path}")
    if model_avg is not None:
        model_avg.load_state_dict({k: v.to(torch.float64) for k, v in unwrap(model).state_dict().items()})
    logging.info(
        f"Initialised the model from the weights of {path} (trained {checkpoint.get('batch_idx_train', '?')} "
        "batches); optimizer, schedule and counters start afresh"
    )


class Resumption:
    """Continuing a run from a checkpoint, all in one place.

    :meth:`load` picks the checkpoint (:func:`resume_checkpoint_path`) and
    loads the weights and the training progress (epoch, batch counters, best
    losses); :meth:`restore_optimizers` loads the optimizer, scheduler and
    grad-scaler states once those exist; :meth:`take_epoch_position` hands the
    first epoch trained the sampler position and RNG states of a run that
    stopped mid-epoch.
    """

    PROGRESS_KEYS = (
        "batch_idx_train",
        "best_train_loss",
        "best_valid_loss",
        "best_train_epoch",
        "best_valid_epoch",
        "skipped_steps",
        "scaler_backoffs",
        "skipped_utterances",
        "train_seconds",
    )

    def __init__(self, checkpoint: Dict[str, Any], rank: int = 0) -> None:
        self.checkpoint: Optional[Dict[str, Any]] = checkpoint
        self.rank = rank

    @classmethod
    def load(
        cls, params: AttributeDict, model: nn.Module, model_avg: Optional[nn.Module], rank: int
    ) -> Optional["Resumption"]:
        """Load the checkpoint to resume from into ``model``/``model_avg``/``params``; None to start afresh."""
        if rank == 0:
            remove_interrupted_saves(params.exp_dir)
        path = resume_checkpoint_path(params)
        if path is None:
            return None
        logging.info(f"Loading checkpoint {path} (use a fresh --exp-dir to start over)")
        checkpoint = load_checkpoint(path, model, model_avg=model_avg)
        for key in cls.PROGRESS_KEYS:
            if key in checkpoint:
                params[key] = checkpoint[key]
        finished_epoch = checkpoint.get("batch_idx_in_epoch", 0) == 0 or path.name.startswith("epoch-")
        params.cur_epoch = int(checkpoint["cur_epoch"]) + (1 if finished_epoch else 0)
        params.batch_idx_in_epoch = 0 if finished_epoch else int(checkpoint["batch_idx_in_epoch"])
        return cls(checkpoint, rank)

    def restore_optimizers(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Eden,
        scaler: Optional[torch.amp.GradScaler],
        grad_control: GradientControl,
    ) -> None:
        """Load the optimizer, scheduler, grad-scaler and gradient-control states the checkpoint holds."""
        owners = (
            ("optimizer", optimizer),
            ("scheduler", scheduler),
            ("grad_scaler", scaler),
            ("grad_control", grad_control),
        )
        for name, obj in owners:
            if obj is not None and self.checkpoint.get(name) is not None:
                obj.load_state_dict(self.checkpoint[name])

    def take_epoch_position(self, params: AttributeDict) -> Optional[Tuple[Optional[Dict], Optional[Dict]]]:
        """``(sampler state, RNG states)`` for the first epoch when the run stopped mid-epoch, else None.

        Answers once: later epochs start from their beginning.
        """
        checkpoint, self.checkpoint = self.checkpoint, None
        if checkpoint is None or params.batch_idx_in_epoch == 0:
            return None
        rng_states = checkpoint.get("rng_states")
        if rng_states is not None and self.rank < len(rng_states):
            return checkpoint.get("sampler"), rng_states[self.rank]  # this rank's own generators
        return checkpoint.get("sampler"), checkpoint.get("rng_state")
