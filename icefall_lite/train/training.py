"""What a training run's loop and step share: :class:`Training` (the run's objects, travelling together;
``params``, icefall's AttributeDict of flags and progress, is updated in place as batches go by and is saved
in every checkpoint), what each step leaves to be logged (:class:`StepOutcome`) and the log of a skipped
step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn

from icefall_lite.train.checkpoint import save_checkpoint
from icefall_lite.train.cuda_graphs import StepGraphs
from icefall_lite.train.diagnostics import ModelDiagnostics
from icefall_lite.train.distributed import gather_objects
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loss import warn_dropped
from icefall_lite.train.optim import Eden
from icefall_lite.train.optimizer_state import SecondMomentMonitor
from icefall_lite.train.rng import get_rng_state
from icefall_lite.train.sequence_log import SequenceLog
from icefall_lite.train.step_log import Scalar, StepLog, read_scalars
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import AttributeDict


@dataclass(frozen=True)
class StepOutcome:
    """What a step leaves to be read at the next :meth:`Training.flush_log`, as device tensors: its dropped
    utterances (the ``finite`` mask over ``cut_ids``), whether it counts as skipped, with the gradient norm and
    the utterances kept (all ranks') that say why, and whether the loss scaler backed off (None without one)."""

    batch_idx: int
    dropped: torch.Tensor
    finite: torch.Tensor
    cut_ids: List[str]
    skipped: torch.Tensor
    grad_norm: torch.Tensor
    utterances: torch.Tensor
    backoff: Optional[torch.Tensor] = None

    def values(self) -> Tuple[Scalar, ...]:
        """(dropped, skipped, grad_norm, utterances, backoff): the values flush_log reads (backoff 0 without a
        loss scaler)."""
        backoff = 0 if self.backoff is None else self.backoff
        return (self.dropped, self.skipped, self.grad_norm, self.utterances, backoff)


@dataclass
class Training:
    """What every epoch of a run uses."""

    params: AttributeDict
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Eden
    grad_control: GradientControl
    sp: spm.SentencePieceProcessor
    model_avg: Optional[nn.Module] = None
    scaler: Optional[torch.amp.GradScaler] = None
    valid_dl: Any = None
    tb_writer: Any = None
    world_size: int = 1
    rank: int = 0
    diagnostics: Optional[ModelDiagnostics] = None
    second_moment: Optional[SecondMomentMonitor] = None
    sequence_log: Optional[SequenceLog] = None
    # --cuda-graphs: the graphs that replay step_on_device, one per static batch shape (None: eager steps).
    graphs: Optional[StepGraphs] = None
    step_log: StepLog = field(init=False)
    # The GradScaler's scale of the last backward (--use-fp16), a device tensor.
    loss_scale: Optional[torch.Tensor] = field(init=False, default=None)
    # Steps skipped (a non-finite gradient norm, or no utterance with a finite loss) since the last flush_log,
    # a device count (what skipped_steps() adds to ``params.skipped_steps``); and each step's outcome since
    # then, read there (one transfer) to log its dropped utterances, its skip and its loss scaler's back-off.
    skipped_on_device: Optional[torch.Tensor] = field(init=False, default=None)
    outcomes: List[StepOutcome] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.step_log = StepLog(self.tb_writer)

    def add_scalar(self, tag: str, value: Scalar, when: Optional[Scalar] = None) -> None:
        """A TensorBoard scalar at the current global batch (rank 0 with --tensorboard), written at the next
        :meth:`flush_log` (only if ``when``, a device flag, is true, where given)."""
        self.step_log.add(tag, value, self.params.batch_idx_train, when)

    def skipped_steps(self) -> Scalar:
        """The steps skipped so far, without a host read (a device tensor once the device has decided one)."""
        if self.skipped_on_device is None:
            return self.params.skipped_steps
        return self.skipped_on_device + self.params.skipped_steps

    def flush_log(self) -> None:
        """Log the steps' dropped utterances and skips, write the queued scalars and the second-moment reports
        (one device-to-host transfer each), and count the skipped steps in ``params.skipped_steps`` and the loss
        scaler's back-offs in ``params.scaler_backoffs``."""
        outcomes, self.outcomes, self.skipped_on_device = self.outcomes, [], None
        values = iter(read_scalars([v for o in outcomes for v in o.values()]))
        for outcome in outcomes:
            dropped, skipped, grad_norm, utterances, backoff = (next(values) for _ in outcome.values())
            if dropped:
                warn_dropped(outcome.cut_ids, outcome.finite)
                self.params.skipped_utterances += int(dropped)
            if skipped:
                reason = "no utterance with a finite loss" if utterances == 0 else f"gradient norm is {grad_norm}"
                log_skip(self.params, outcome.batch_idx, reason)
            self.params.scaler_backoffs += int(backoff)
        if self.second_moment is not None:
            for step, moment in self.second_moment.reports():
                self.step_log.add(TB_TAGS.exp_avg_sq_jump, moment.jump, step)
                if moment.recovery_steps:
                    self.step_log.add(TB_TAGS.exp_avg_sq_recovery, max(moment.recovery_steps), step)
        self.step_log.flush()
        if self.sequence_log is not None:
            self.sequence_log.flush()

    def save(self, filename: Path, train_dl) -> None:
        """Rank 0 saves model, model_avg, optimizer, scheduler, scaler, sampler position and the RNG states of
        every rank (a collective under DDP: every rank calls this)."""
        rng_states = gather_objects(get_rng_state(train_dl))
        if self.sequence_log is not None:  # every rank's steps up to the checkpoint, for a resumed run
            self.sequence_log.flush()
        if self.rank != 0:
            return
        self.flush_log()
        save_checkpoint(
            filename,
            model=self.model,
            model_avg=self.model_avg,
            params=self.params,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.scaler,
            sampler=None if train_dl is None else train_dl.sampler,
            extra={
                "rng_state": rng_states[0],
                "rng_states": rng_states,
                "grad_control": self.grad_control.state_dict(),
            },
        )


def log_skip(params: AttributeDict, batch_idx: int, reason: str) -> None:
    """Count a skipped step in ``params.skipped_steps`` and log it (icefall's warning)."""
    params.skipped_steps += 1
    logging.warning(f"Skipping step at batch {batch_idx}: {reason} (skipped steps so far: {params.skipped_steps})")
