"""Distributed training plumbing: how this process was launched, and the small collectives that keep the
decisions of DDP ranks identical.

Two launchers start the ranks of a run:

- ``train.py --world-size N`` spawns N processes on this machine (torch.multiprocessing);
- ``torchrun`` (``python -m torch.distributed.run``, on one machine or several, also under SLURM's
  ``srun``) starts ``train.py`` once per rank with the rank in the environment: ``RANK`` (global),
  ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (this machine's), ``MASTER_ADDR``/``MASTER_PORT``.

:class:`Placement` is where a process sits in either case. Every rank reads its data share from the
GLOBAL rank and world size: lhotse's samplers take ``RANK``/``WORLD_SIZE`` from the environment when they
are there (torchrun) and from the process group otherwise (spawn).

:func:`summed_over_ranks` and :func:`any_rank` are collectives: every rank must call them at the same point of
the run, and they are no-ops (no communication) unless a process group of more than one rank exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

import torch
import torch.distributed as dist

# What torchrun sets for every process it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_MASTER_PORT = 12354


class LaunchError(ValueError):
    """The launcher's settings cannot work (the message names the flag or variable and the fix)."""


@dataclass(frozen=True)
class Placement:
    """Where a training process sits: its global ``rank`` of ``world_size``, and its ``local_rank`` of the
    ``local_world_size`` processes on this machine (its GPU: ``cuda:<local_rank>``); ``launcher`` is
    ``"torchrun"``, ``"spawn"`` (``--world-size``) or ``"single"`` (one process)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str

    @property
    def distributed(self) -> bool:
        """Whether the run has more than one rank (a process group, DDP)."""
        return self.world_size > 1


def torchrun_placement(environ: Optional[Mapping[str, str]] = None) -> Optional[Placement]:
    """The placement torchrun's environment variables describe; None when none of ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` is set (not launched by torchrun).

    Raises :class:`LaunchError` when only some of :data:`TORCHRUN_VARIABLES` are set or they are
    inconsistent: a stray ``RANK`` or ``WORLD_SIZE`` would also change the data share lhotse's sampler takes.
    """
    environ = os.environ if environ is None else environ
    if not any(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        present = ", ".join(f"{n}={environ[n]}" for n in TORCHRUN_VARIABLES if n in environ)
        raise LaunchError(
            f"the environment sets {present} but not {', '.join(missing)}: launch train.py with torchrun "
            "(python -m torch.distributed.run), which sets all of " + ", ".join(TORCHRUN_VARIABLES) + ", or unset "
            "them and use --world-size N to start N processes on this machine"
        )
    try:
        values = {name: int(environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    except ValueError as e:
        raise LaunchError(f"torchrun's rank variables must be integers: {e}") from None
    rank, world_size = values["RANK"], values["WORLD_SIZE"]
    local_rank, local_world_size = values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise LaunchError(
            f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}, "
            f"LOCAL_WORLD_SIZE={local_world_size}"
        )
    return Placement(rank, world_size, local_rank, local_world_size, "torchrun")


def threads_per_rank(placement: Placement, environ: Optional[Mapping[str, str]] = None, cores: int = 0) -> int:
    """CPU threads for each process of this machine: ``OMP_NUM_THREADS`` when it is set (torchrun sets 1 for
    several processes per node), else the machine's ``cores`` (``os.cpu_count()`` when 0) shared out among its
    ``local_world_size`` processes, so that 8 ranks on one host do not each start a thread per core."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip():
        return max(1, int(environ["OMP_NUM_THREADS"]))
    return max(1, (cores or os.cpu_count() or 1) // placement.local_world_size)


def spawn_placement(rank: int, world_size: int) -> Placement:
    """Rank ``rank`` of the ``world_size`` processes that ``--world-size`` spawns on this machine."""
    return Placement(rank, world_size, rank, world_size, "spawn" if world_size > 1 else "single")


def shared_store_restart_problem(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why a torchrun restart (``--max-restarts``) of this multi-process job would fail to rejoin, or None.

    When torchrun's agent shares its rendezvous store with the process group
    (``TORCHELASTIC_USE_AGENT_STORE=True``: the static rendezvous, and c10d's by default), the store keeps
    the previous attempt's addresses, which the restarted processes can read: they fail to connect or hang
    (PyTorch issue 135712, seen with gloo and torch 2.13 on one machine).
    """
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    if environ.get("WORLD_SIZE", "1") == "1":
        return None
    return (
        "torchrun shares its rendezvous store with the process group (TORCHELASTIC_USE_AGENT_STORE=True), so "
        "processes restarted by --max-restarts can read the previous attempt's addresses and fail to connect "
        "(PyTorch issue 135712): start torchrun with --rdzv-backend c10d (or --standalone) and "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
    )


def check_launch(world_size_flag: int, environ: Optional[Mapping[str, str]] = None, num_gpus: int = 0) -> None:
    """Refuse a launch that cannot work, with the fix: torchrun's environment together with
    ``--world-size`` > 1, a torchrun restart that would not rejoin (:func:`shared_store_restart_problem`),
    or more processes on this machine than ``num_gpus`` visible GPUs (``num_gpus`` = 0: no CUDA, CPU
    processes with gloo, any number).

    Raises :class:`LaunchError` (and what :func:`torchrun_placement` raises).
    """
    placement = torchrun_placement(environ)
    if placement is not None and world_size_flag > 1:
        raise LaunchError(
            f"--world-size {world_size_flag} under torchrun (WORLD_SIZE={placement.world_size} in the environment):"
            " torchrun starts the processes itself; drop --world-size and set the number of ranks with torchrun's "
            "--nproc-per-node (and --nnodes)"
        )
    environ = os.environ if environ is None else environ
    restart_problem = shared_store_restart_problem(environ)
    if placement is not None and environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and restart_problem:
        raise LaunchError(
            f"this is a restart (TORCHELASTIC_RESTART_COUNT={environ['TORCHELASTIC_RESTART_COUNT']}) but "
            + restart_problem
        )
    if num_gpus <= 0:
        return
    if placement is not None and placement.local_world_size > num_gpus:
        raise LaunchError(
            f"torchrun started {placement.local_world_size} processes on this machine (LOCAL_WORLD_SIZE) but "
            f"{num_gpus} GPU(s) are visible: use torchrun --nproc-per-node {num_gpus} (or fewer)"
        )
    if placement is None and world_size_flag > num_gpus:
        raise LaunchError(
            f"--world-size {world_size_flag} asks for one GPU per process but {num_gpus} GPU(s) are visible: "
            f"use --world-size {num_gpus} (or fewer), or torchrun to use the GPUs of several machines"
        )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> torch.device:
    """Where a collective's tensor must live: the current GPU for nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def summed_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` (a device tensor) summed over every rank of the process group, without a host read
    (``value`` itself without one)."""
    if _world_size() <= 1:
        return value
    out = value.to(_collective_device(), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(value.device)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on at least one rank of the process group (``flag`` itself without one)."""
    if _world_size() <= 1:
        return bool(flag)
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def gather_objects(obj: Any) -> List[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    if _world_size() <= 1:
        return [obj]
    objects: List[Any] = [None] * _world_size()
    dist.all_gather_object(objects, obj)
    return objects


def same_on_all_ranks(value: int) -> bool:
    """Whether the integer ``value`` is the same on every rank (True without a process group)."""
    if _world_size() <= 1:
        return True
    tensor = torch.tensor([int(value), -int(value)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor[0].item()) == -int(tensor[1].item())
