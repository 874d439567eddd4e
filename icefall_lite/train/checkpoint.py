"""Checkpoint files: atomic save, checked load, finding and pruning ``checkpoint-<batch>.pt``.

The format is icefall's (``icefall/checkpoint.py`` and the ``train.py`` of
``lstm_transducer_stateless3``): a dict with ``model`` (the state dict, with
icefall's parameter names since the module tree is icefall's), ``optimizer``,
``scheduler``, ``grad_scaler``, ``sampler`` (None when absent),
``model_avg`` (only when there is one) and the training progress
(``batch_idx_train``, ``cur_epoch``, best losses, ...) at the top level; we
add ``rng_state`` for an exact resume. icefall's ``pretrained.pt``
(``{"model": state_dict}``) and ``epoch-N.pt`` load as they are, a DDP
``module.`` prefix included, and icefall's code loads the files written here.

Averaging and icefall's choice of the weights to decode are in
:mod:`icefall_lite.train.averaging`; the scripts' checkpoint flags in
:mod:`icefall_lite.train.checkpoint_args`. Errors are raised as
:class:`CheckpointError` with a message naming the file and the fix.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

from icefall_lite.utils import atomic_output, temp_name

PathLike = Union[str, Path]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, truncated, foreign or of another model size."""


def atomic_torch_save(obj: Any, filename: PathLike) -> None:
    """``torch.save`` through :func:`icefall_lite.utils.atomic_output`, fsynced before the rename.

    A process killed mid-write leaves at most the temporary
    ``.tmp-<name>`` (:func:`icefall_lite.utils.temp_name`), never a truncated
    ``filename``.
    """
    with atomic_output(filename) as tmp:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def save_checkpoint(
    filename: PathLike,
    model: nn.Module,
    model_avg: Optional[nn.Module] = None,
    params: Optional[Dict[str, Any]] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    sampler: Optional[Any] = None,
    extra: Optional[Dict[str, Any]] = None,
) -> None:
    """Save everything needed to resume, atomically, in icefall's layout (see the module doc).

    ``params`` holds the training progress; its plain values (numbers,
    strings, paths) go to the top level of the file, as icefall's.
    """
    checkpoint: Dict[str, Any] = {
        "model": unwrap(model).state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "grad_scaler": None if scaler is None else scaler.state_dict(),
        "sampler": None if sampler is None else sampler.state_dict(),
    }
    if model_avg is not None:  # icefall writes the key only when there is an averaged model
        checkpoint["model_avg"] = model_avg.state_dict()
    if params is not None:
        checkpoint.update({k: v for k, v in params.items() if _is_plain(v)})
    if extra:
        checkpoint.update(extra)
    atomic_torch_save(checkpoint, filename)


def _is_plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool, type(None), Path))


def load_checkpoint_file(filename: PathLike) -> Dict[str, Any]:
    """Read a checkpoint file with a clear error when it is missing, truncated or foreign."""
    filename = Path(filename)
    if not filename.is_file():
        raise CheckpointError(f"Checkpoint {filename} does not exist. Check --exp-dir and --epoch/--iter.")
    try:
        checkpoint = torch.load(filename, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises several types for a damaged zip/pickle
        raise CheckpointError(
            f"Checkpoint {filename} cannot be read ({type(e).__name__}: {e}). It is truncated or not a "
            "torch checkpoint: if training wrote it, delete it and resume from an earlier one (e.g. --start-epoch "
            "of the previous epoch); if it was downloaded, download it again."
        ) from e
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        raise CheckpointError(
            f"Checkpoint {filename} is not an icefall or icefall-lite checkpoint (no 'model' state dict); "
            "it may come from another program."
        )
    return checkpoint


DDP_PREFIX = "module."
# The names this package used before it took icefall's (``encoder.layers.N.`` for
# ``encoder.encoder.layers.N.``, ``lstm._scales.<i>`` for ``lstm.<flat weight>_scale``).
_OLD_NAMES = re.compile(r"^encoder\.layers\.\d+\.|\.lstm\._scales\.\d+$")
_SHOWN_KEYS = 10


def strip_ddp_prefix(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The state dict without DDP's ``module.`` prefix when every name has it (as icefall's load_checkpoint)."""
    if state_dict and all(k.startswith(DDP_PREFIX) for k in state_dict):
        return {k[len(DDP_PREFIX) :]: v for k, v in state_dict.items()}
    return state_dict


def _first(keys: List[str], total: int) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return f"{shown}, ... ({total} in all)" if total > _SHOWN_KEYS else shown


def load_state_dict_checked(module: nn.Module, state_dict: Dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict(strict=True)`` with an error naming the first mismatched names and shapes.

    A DDP ``module.`` prefix on every name is dropped, as icefall's
    ``load_checkpoint`` does. Entries under the module's
    ``TRAINING_ONLY_PREFIXES`` (e.g. a CTC head used only in training) that
    the module lacks are dropped too. A checkpoint of another architecture or
    size raises :class:`CheckpointError` listing, in order, the first names
    missing in the checkpoint, the first it has and the model lacks, and the
    shapes that differ; one with this package's names from before it took
    icefall's says so.
    """
    own = module.state_dict()
    state_dict = strip_ddp_prefix(state_dict)
    prefixes = tuple(getattr(module, "TRAINING_ONLY_PREFIXES", ()))
    if prefixes:
        state_dict = {k: v for k, v in state_dict.items() if k in own or not k.startswith(prefixes)}
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    mismatched = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state_dict and tuple(state_dict[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or mismatched:
        if missing or unexpected:
            headline = (
                f"{source} does not fit this model (another architecture, or other model-size flags than in "
                f"training?): {len(missing)} of the model's {len(own)} names are missing in it and "
                f"{len(unexpected)} of its {len(state_dict)} names are unknown to the model. "
                "(icefall's lstm_transducer_stateless3 is --model-preset icefall.)"
            )
        else:
            headline = f"{source} does not fit this model (were the model-size flags the same as in training?)."
        lines = [headline]
        if any(_OLD_NAMES.search(k) for k in unexpected):
            lines.append(
                "Its names are icefall-lite's from before it took icefall's checkpoint format "
                "(encoder.layers.N. for encoder.encoder.layers.N., lstm._scales.I for lstm.<flat weight>_scale): "
                "checkpoints of runs made before that change cannot be loaded; train again."
            )
        if mismatched:
            lines.append("Mismatched shapes:\n  " + "\n  ".join(mismatched[:_SHOWN_KEYS]))
            if len(mismatched) > _SHOWN_KEYS:
                lines.append(f"  ... ({len(mismatched)} in all)")
        if missing:
            lines.append("Missing in checkpoint: " + _first(missing, len(missing)))
        if unexpected:
            lines.append("Unexpected in checkpoint: " + _first(unexpected, len(unexpected)))
        raise CheckpointError("\n".join(lines))
    module.load_state_dict(state_dict, strict=True)


def load_checkpoint(
    filename: PathLike,
    model: nn.Module,
    model_avg: Optional[nn.Module] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[Any] = None,
    scaler: Optional[Any] = None,
    sampler: Optional[Any] = None,
) -> Dict[str, Any]:
    """Load a checkpoint into the given objects; returns the whole checkpoint dict."""
    checkpoint = load_checkpoint_file(filename)
    load_state_dict_checked(unwrap(model), checkpoint["model"], str(filename))
    if model_avg is not None and checkpoint.get("model_avg") is not None:
        load_state_dict_checked(model_avg, checkpoint["model_avg"], f"{filename} (model_avg)")
    for name, obj in (
        ("optimizer", optimizer),
        ("scheduler", scheduler),
        ("grad_scaler", scaler),
        ("sampler", sampler),
    ):
        if obj is not None and checkpoint.get(name) is not None:
            obj.load_state_dict(checkpoint[name])
    return checkpoint


def find_checkpoints(out_dir: PathLike) -> List[Path]:
    """``checkpoint-<batch>.pt`` files in ``out_dir``, newest (largest batch) first."""
    pattern = re.compile(r"checkpoint-(\d+)\.pt$")
    found = []
    for path in glob.glob(f"{out_dir}/checkpoint-[0-9]*.pt"):
        m = pattern.search(path)
        if m:
            found.append((int(m.group(1)), Path(path)))
    return [p for _, p in sorted(found, reverse=True)]


def remove_checkpoints(out_dir: PathLike, keep_last_k: int) -> None:
    """Delete all but the newest ``keep_last_k`` ``checkpoint-<batch>.pt`` files (0 = keep all)."""
    if keep_last_k <= 0:
        return
    for path in find_checkpoints(out_dir)[keep_last_k:]:
        path.unlink(missing_ok=True)


def remove_interrupted_saves(exp_dir: PathLike) -> None:
    """Delete the temporary files (``.tmp-<name>.pt``) of checkpoint saves a killed process left."""
    for stale in Path(exp_dir).glob(temp_name(Path("*.pt")).name):
        logging.warning(f"Removing {stale}, left by an interrupted checkpoint save")
        stale.unlink(missing_ok=True)
