"""Averaging weights: icefall's running ``model_avg`` during training, and its
``--epoch/--iter/--avg/--use-averaged-model`` choice of the weights to decode or export.

Checkpoint selection (as icefall's decode.py and export scripts):

- ``use_averaged_model`` with ``iter == 0``: the average of the model over the
  batches between ``epoch-(E-A).pt`` (excluded) and ``epoch-E.pt``, from their
  ``model_avg`` entries; needs ``A < E``.
- ``use_averaged_model`` with ``iter = I > 0``: the same between the newest
  and the ``A``-th older ``checkpoint-<batch>.pt`` with batch <= I.
- ``use_averaged_model`` false: the element-wise mean of the ``model`` entries
  of ``epoch-(E-A+1).pt .. epoch-E.pt`` (or of the ``A`` newest
  ``checkpoint-<batch>.pt`` with batch <= I).
- ``--checkpoint PATH`` (any file in icefall's format, e.g. icefall's
  published ``pretrained.pt``, anywhere): its ``model`` entry as it is; the
  flags above are not used.

:func:`select_checkpoints` makes the :class:`CheckpointPlan`,
:func:`averaged_state_dict` computes its weights, :func:`load_averaged_weights`
does both and loads them into a model; :func:`checkpoint_suffix` is the
``epoch-E-avg-A`` / ``iter-I-avg-A`` (or, with ``--checkpoint``, the file's name) part of
icefall's result and export file names.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from icefall_lite.train.checkpoint import (
    CheckpointError,
    PathLike,
    find_checkpoints,
    load_checkpoint_file,
    load_state_dict_checked,
    unwrap,
)


@torch.no_grad()
def update_averaged_model(
    average_period: int, batch_idx_train: int, model_cur: nn.Module, model_avg: nn.Module
) -> None:
    """icefall's running average: ``avg = cur * w + avg * (1 - w)``, ``w = average_period / batch_idx_train``.

    Called every ``average_period`` batches, this keeps ``model_avg`` equal to
    the mean of the model over all those calls.
    """
    weight_cur = average_period / batch_idx_train
    cur = unwrap(model_cur).state_dict()
    for name, avg_value in model_avg.state_dict().items():
        if avg_value.dtype.is_floating_point:
            avg_value.mul_(1.0 - weight_cur).add_(cur[name].to(avg_value.device), alpha=weight_cur)
        else:
            avg_value.copy_(cur[name])


def average_checkpoints(
    filenames: List[PathLike], device: torch.device = torch.device("cpu")
) -> Dict[str, torch.Tensor]:
    """Element-wise mean of the ``model`` entries of several checkpoints (integer buffers: from the first)."""
    if not filenames:
        raise CheckpointError("average_checkpoints needs at least one checkpoint")
    states = [load_checkpoint_file(f)["model"] for f in filenames]
    avg = {k: v.clone().to(device) for k, v in states[0].items()}
    for k, v in avg.items():
        if v.dtype.is_floating_point:
            for other in states[1:]:
                v.add_(other[k].to(device))
            v.div_(len(states))
    return avg


def average_checkpoints_with_averaged_model(
    filename_start: PathLike, filename_end: PathLike, device: torch.device = torch.device("cpu")
) -> Dict[str, torch.Tensor]:
    """Average of the model over the batches between two checkpoints, from their ``model_avg``.

    ``avg = (avg_end * b_end - avg_start * b_start) / (b_end - b_start)`` with
    ``b`` the ``batch_idx_train`` stored in each checkpoint (icefall's formula).
    """
    start = load_checkpoint_file(filename_start)
    end = load_checkpoint_file(filename_end)
    for name, ckpt in ((filename_start, start), (filename_end, end)):
        if ckpt.get("model_avg") is None:
            raise CheckpointError(f"{name} has no model_avg; decode with --use-averaged-model False")
    b_start, b_end = int(start["batch_idx_train"]), int(end["batch_idx_train"])
    if not b_end > b_start:
        raise CheckpointError(
            f"{filename_end} (batch {b_end}) must come after {filename_start} (batch {b_start}) for averaging"
        )
    weight_end = b_end / (b_end - b_start)
    weight_start = -b_start / (b_end - b_start)
    avg = {}
    for k, v_end in end["model_avg"].items():
        v_end = v_end.to(device)
        if v_end.dtype.is_floating_point:
            avg[k] = v_end * weight_end + start["model_avg"][k].to(device) * weight_start
        else:
            avg[k] = v_end.clone()
    return avg


@dataclass
class CheckpointPlan:
    """Which checkpoint files make the model, and how.

    ``averaged_model``: the average between ``filenames[0]`` (excluded) and
    ``filenames[1]`` from their ``model_avg``; else the mean of the ``model``
    entries of all ``filenames``. ``one_file``: ``--checkpoint``, the ``model``
    entry of the one file.
    """

    filenames: List[Path]
    averaged_model: bool
    one_file: bool = False

    def describe(self) -> str:
        """E.g. ``the averaged model from exp/epoch-5.pt (excluded) to exp/epoch-8.pt``."""
        if self.one_file:
            return f"the model of {self.filenames[0]}"
        if self.averaged_model:
            return f"the averaged model from {self.filenames[0]} (excluded) to {self.filenames[1]}"
        return "the average of " + ", ".join(str(f) for f in self.filenames)


def checkpoint_file_suffix(checkpoint: PathLike) -> str:
    """The file-name suffix of ``--checkpoint PATH``: the file's name without ``.pt``, characters other than
    letters, digits, ``.``, ``_`` and ``-`` replaced by ``_`` (``exp/pretrained.pt`` -> ``pretrained``)."""
    name = Path(checkpoint).name
    stem = name[: -len(".pt")] if name.endswith(".pt") and len(name) > len(".pt") else name
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem)


def checkpoint_suffix(epoch: int, iter: int, avg: int, checkpoint: Optional[PathLike] = None) -> str:
    """icefall's file-name suffix: ``iter-<iter>-avg-<avg>`` when ``iter > 0``, else ``epoch-<epoch>-avg-<avg>``;
    with ``checkpoint`` (``--checkpoint``), :func:`checkpoint_file_suffix` of it."""
    if checkpoint is not None:
        return checkpoint_file_suffix(checkpoint)
    return f"iter-{iter}-avg-{avg}" if iter > 0 else f"epoch-{epoch}-avg-{avg}"


def _epoch_number(path: Path) -> int:
    return int(re.fullmatch(r"epoch-(\d+)\.pt", path.name).group(1))


def available_epoch_checkpoints(exp_dir: PathLike) -> List[Path]:
    """``epoch-<N>.pt`` files in ``exp_dir``, by epoch."""
    found = [p for p in Path(exp_dir).glob("epoch-*.pt") if re.fullmatch(r"epoch-\d+\.pt", p.name)]
    return sorted(found, key=_epoch_number)


def _found_str(paths: Sequence[Path], what: str) -> str:
    return ", ".join(p.name for p in paths) if paths else f"no {what} files"


def _avg_too_large_message(exp_dir: Path, epoch: int, avg: int, use_averaged_model: bool, found: str) -> str:
    """Why ``--avg`` does not fit ``--epoch``, and the fix."""
    if use_averaged_model:
        rule = (
            f"averages the model between epoch-(EPOCH-AVG).pt (excluded) and epoch-{epoch}.pt, "
            "so --avg must be below --epoch"
        )
        fix = (
            f"use --avg {epoch - 1} or less, or --use-averaged-model false"
            if epoch > 1
            else "use --use-averaged-model false"
        )
    else:
        rule = f"averages epoch-(EPOCH-AVG+1).pt .. epoch-{epoch}.pt, so --avg must be at most --epoch"
        fix = f"use --avg {epoch} or less"
    return (
        f"--avg {avg} is too large for --epoch {epoch}: --use-averaged-model "
        f"{str(use_averaged_model).lower()} {rule}; {fix}. Found in {exp_dir}: {found}."
    )


def _epoch_plan(exp_dir: Path, epoch: int, avg: int, use_averaged_model: bool) -> CheckpointPlan:
    """icefall's epoch rule: ``epoch-(E-A).pt`` & ``epoch-E.pt`` (averaged model), or ``epoch-(E-A+1..E).pt``."""
    first = epoch - avg if use_averaged_model else epoch - avg + 1
    found = _found_str(available_epoch_checkpoints(exp_dir), "epoch-*.pt")
    if first < 1:
        raise CheckpointError(_avg_too_large_message(exp_dir, epoch, avg, use_averaged_model, found))
    numbers = [first, epoch] if use_averaged_model else list(range(first, epoch + 1))
    filenames = [exp_dir / f"epoch-{n}.pt" for n in numbers]
    missing = [f.name for f in filenames if not f.is_file()]
    if missing:
        raise CheckpointError(
            f"--epoch {epoch} --avg {avg} --use-averaged-model {str(use_averaged_model).lower()} needs "
            f"{', '.join(f.name for f in filenames)} in {exp_dir}; missing: {', '.join(missing)}. Found: {found}."
        )
    return CheckpointPlan(filenames, use_averaged_model)


def _batch_of(path: Path) -> int:
    return int(re.search(r"checkpoint-(\d+)\.pt$", path.name).group(1))


def _iter_plan(exp_dir: Path, iteration: int, avg: int, use_averaged_model: bool) -> CheckpointPlan:
    """icefall's ``--iter`` rule: the newest ``checkpoint-<batch>.pt`` with batch <= iter, and older ones."""
    candidates = [p for p in find_checkpoints(exp_dir) if _batch_of(p) <= iteration]
    needed = avg + 1 if use_averaged_model else avg
    if len(candidates) < needed:
        raise CheckpointError(
            f"Not enough checkpoints ({len(candidates)}) found for --iter {iteration}, --avg {avg}: "
            f"--use-averaged-model {str(use_averaged_model).lower()} needs {needed} checkpoint-<batch>.pt files "
            f"with batch <= {iteration} in {exp_dir}. "
            f"Found: {_found_str(find_checkpoints(exp_dir), 'checkpoint-*.pt')}."
        )
    chosen = candidates[:needed]
    if use_averaged_model:
        return CheckpointPlan([chosen[-1], chosen[0]], True)
    return CheckpointPlan(chosen, False)


def select_checkpoints(
    exp_dir: PathLike, *, epoch: int, iter: int = 0, avg: int, use_averaged_model: bool
) -> CheckpointPlan:
    """The checkpoint files of ``--epoch``/``--iter``, ``--avg`` and ``--use-averaged-model``, as icefall chooses them.

    Args:
      exp_dir: the folder of ``epoch-<N>.pt`` and ``checkpoint-<batch>.pt``.
      epoch: the last epoch (used when ``iter == 0``), >= 1.
      iter: if > 0, use ``checkpoint-<batch>.pt`` files with batch <= ``iter`` instead of epochs.
      avg: how many checkpoints (or, with ``use_averaged_model``, how many epochs/checkpoints back), >= 1.
      use_averaged_model: average with the ``model_avg`` of two checkpoints (see the module doc).
    Raises:
      ValueError: ``avg < 1``, ``iter < 0`` or (with ``iter == 0``) ``epoch < 1``.
      CheckpointError: a clear message naming the needed and the found files, and the fix.
    """
    if avg < 1:
        raise ValueError(f"--avg must be >= 1, got {avg}")
    if iter < 0:
        raise ValueError(f"--iter must be >= 0, got {iter}")
    exp_dir = Path(exp_dir)
    if iter > 0:
        return _iter_plan(exp_dir, iter, avg, use_averaged_model)
    if epoch < 1:
        raise ValueError(f"--epoch must be >= 1, got {epoch}")
    return _epoch_plan(exp_dir, epoch, avg, use_averaged_model)


def averaged_state_dict(plan: CheckpointPlan, device: torch.device) -> Dict[str, torch.Tensor]:
    """The state dict ``plan`` describes, on ``device`` (CheckpointError if the files do not fit each other)."""
    try:
        if plan.averaged_model:
            return average_checkpoints_with_averaged_model(plan.filenames[0], plan.filenames[1], device=device)
        return average_checkpoints(plan.filenames, device=device)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError) as e:
        raise CheckpointError(
            f"Cannot average {', '.join(str(f) for f in plan.filenames)}: they do not come from the same model "
            f"({type(e).__name__}: {e})"
        ) from e


def load_averaged_weights(
    model: nn.Module,
    exp_dir: PathLike,
    *,
    epoch: int,
    iter: int = 0,
    avg: int,
    use_averaged_model: bool,
    device: torch.device,
) -> CheckpointPlan:
    """Select (:func:`select_checkpoints`), average and load the checkpoints into ``model``.

    The weights are averaged on ``device``; a checkpoint of another model size
    gives a CheckpointError that lists the mismatched names and shapes.

    Returns:
      the plan that was loaded (``plan.describe()`` names the files).
    """
    plan = select_checkpoints(exp_dir, epoch=epoch, iter=iter, avg=avg, use_averaged_model=use_averaged_model)
    logging.info(f"Loading {plan.describe()}")
    load_state_dict_checked(model, averaged_state_dict(plan, device), plan.describe())
    return plan


def load_checkpoint_weights(model: nn.Module, filename: PathLike, device: torch.device) -> CheckpointPlan:
    """``--checkpoint``: load the ``model`` entry of one file (icefall's ``pretrained.pt`` or ``epoch-N.pt``,
    or one written here) into ``model``, on ``device``.

    Raises:
      CheckpointError: a missing, truncated or foreign file, or weights of another architecture or size
        (naming the first mismatched names).
    """
    plan = CheckpointPlan([Path(filename)], averaged_model=False, one_file=True)
    logging.info(f"Loading {plan.describe()}")
    state_dict = {k: v.to(device) for k, v in load_checkpoint_file(filename)["model"].items()}
    load_state_dict_checked(model, state_dict, plan.describe())
    return plan


def load_weights_from_flags(model: nn.Module, flags: Mapping[str, Any], device: torch.device) -> CheckpointPlan:
    """:func:`load_checkpoint_weights` of ``flags["checkpoint"]`` when it is set, else
    :func:`load_averaged_weights` of the checkpoint flags in ``flags`` (``exp_dir``, ``epoch``, ``iter``,
    ``avg``, ``use_averaged_model``; :mod:`icefall_lite.train.checkpoint_args`)."""
    if flags.get("checkpoint") is not None:
        return load_checkpoint_weights(model, flags["checkpoint"], device)
    return load_averaged_weights(
        model,
        flags["exp_dir"],
        epoch=flags["epoch"],
        iter=flags["iter"],
        avg=flags["avg"],
        use_averaged_model=flags["use_averaged_model"],
        device=device,
    )
