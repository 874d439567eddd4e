"""The training loop: one step, one epoch, the epochs of a run, validation and the checkpoints they save.

A run's objects travel together in :class:`Training`; ``params`` (icefall's
AttributeDict of flags and progress) is updated in place as batches go by and
is saved in every checkpoint.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn

from icefall_lite.data.datamodule import LibriSpeechAsrDataModule
from icefall_lite.train.averaging import update_averaged_model
from icefall_lite.train.checkpoint import remove_checkpoints, save_checkpoint, unwrap
from icefall_lite.train.cuda_graphs import StepGraphs
from icefall_lite.train.diagnostics import ModelDiagnostics
from icefall_lite.train.distributed import any_rank, gather_objects, summed_over_ranks
from icefall_lite.train.grad_control import GradientControl
from icefall_lite.train.loss import LossInputs, batch_loss, compute_loss, loss_inputs, warn_dropped
from icefall_lite.train.optim import Eden, ScaledAdam
from icefall_lite.train.optimizer_state import SecondMomentMonitor
from icefall_lite.train.resume import Resumption
from icefall_lite.train.rng import fix_random_seed, get_rng_state, set_rng_state
from icefall_lite.train.sequence_log import SequenceLog
from icefall_lite.train.step_log import Scalar, StepLog, read_metrics, read_scalars
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.utils import AttributeDict, MetricsTracker, progress_bar

DIAGNOSTICS_BATCHES = 5


@dataclass(frozen=True)
class StepOutcome:
    """What a step leaves to be read at the next :meth:`Training.flush_log`, as device tensors: its dropped
    utterances (the ``finite`` mask over ``cut_ids``), and whether the device skipped it (``skipped``, None
    where the host decided), with the gradient norm and the utterances kept (all ranks') that say why."""

    batch_idx: int
    dropped: torch.Tensor
    finite: torch.Tensor
    cut_ids: List[str]
    skipped: Optional[torch.Tensor] = None
    grad_norm: Optional[torch.Tensor] = None
    utterances: Optional[torch.Tensor] = None

    def values(self) -> Tuple[Scalar, Scalar, Scalar, Scalar]:
        """(dropped, skipped, grad_norm, utterances): the values flush_log reads (0 for the host's None)."""
        return tuple(0 if v is None else v for v in (self.dropped, self.skipped, self.grad_norm, self.utterances))


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
    # Steps skipped on the device's decision (a non-finite gradient norm, or no utterance with a finite loss)
    # since the last flush_log, a device count added to ``params.skipped_steps`` there; and each step's
    # outcome since then, read there (one transfer) to log its dropped utterances and, if it was skipped,
    # the skip, as the host-decided paths log them at once.
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
        """Log the steps' dropped utterances and device-decided skips, write the queued scalars and the
        second-moment reports (one device-to-host transfer each), and add the device's count of skipped steps
        to ``params.skipped_steps``."""
        outcomes, self.outcomes, self.skipped_on_device = self.outcomes, [], None
        values = iter(read_scalars([v for o in outcomes for v in o.values()]))
        for outcome in outcomes:
            dropped, skipped, grad_norm, utterances = (next(values) for _ in outcome.values())
            if dropped:
                warn_dropped(outcome.cut_ids, outcome.finite)
                self.params.skipped_utterances += int(dropped)
            if skipped:
                reason = "no utterance with a finite loss" if utterances == 0 else f"gradient norm is {grad_norm}"
                log_skip(self.params, outcome.batch_idx, reason)
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


# --------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------


def mixed_precision(params: AttributeDict, device: torch.device) -> torch.autocast:
    """The autocast of a training step on ``device``: float16 with --use-fp16, bfloat16 with --use-bf16, else
    off (float32). Without autocast's cache of cast weights, which a CUDA graph's capture cannot keep (each
    weight is cast where it is used, once per step here)."""
    dtype = torch.float16 if params.use_fp16 else torch.bfloat16
    enabled = params.use_fp16 or params.use_bf16
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled, cache_enabled=False)


def log_skip(params: AttributeDict, batch_idx: int, reason: str) -> None:
    """Count a skipped step in ``params.skipped_steps`` and log it (icefall's warning)."""
    params.skipped_steps += 1
    logging.warning(f"Skipping step at batch {batch_idx}: {reason} (skipped steps so far: {params.skipped_steps})")


def train_step(t: Training, batch: Dict[str, Any]) -> Tuple[MetricsTracker, torch.Tensor, torch.Tensor]:
    """One training step on a lhotse batch (``t.params.batch_idx_train`` already counts it):
    :func:`prepare_step` on the host, then :func:`device_step`."""
    return device_step(t, prepare_step(t, batch))


def prepare_step(t: Training, batch: Dict[str, Any]) -> LossInputs:
    """The host's part of a step: the batch's :class:`LossInputs`, and Eden's learning rate of this update
    (as icefall: the rate of update b is Eden's at batch b), staged on the device for Eve before the step."""
    t.scheduler.step_batch(t.params.batch_idx_train)
    return loss_inputs(t.params, t.sp, batch)


@dataclass(frozen=True)
class DeviceStep:
    """A step decided on the device (:func:`step_on_device`), every field a device tensor: the batch's sums,
    the pre-clip gradient norm and the clip scale (0-dim), the utterances with a finite loss ((N,) bool),
    whether the step was skipped and the utterances kept on all ranks (0-dim)."""

    info: MetricsTracker
    grad_norm: torch.Tensor
    clip_scale: torch.Tensor
    finite: torch.Tensor
    skipped: torch.Tensor
    utterances: torch.Tensor


def decided_on_device(t: Training) -> bool:
    """Whether the step's skip is decided on the device: with Eve and no loss scaler (float32, bfloat16)."""
    return t.scaler is None and not isinstance(t.optimizer, ScaledAdam)


def device_step(t: Training, inputs: LossInputs) -> Tuple[MetricsTracker, torch.Tensor, torch.Tensor]:
    """Forward, backward, clip and update on one batch (its inputs and learning rate from
    :func:`prepare_step`).

    A step whose gradient norm is not finite, or whose batch has no utterance
    with a finite loss, is skipped: no update, counted in
    ``params.skipped_steps`` and logged. With Eve in float32 or bfloat16 the skip
    is decided on the device (:func:`step_on_device`, replayed as a CUDA graph with ``t.graphs``), and
    counted and logged at :meth:`Training.flush_log` (``--log-interval``), as the dropped utterances are: then
    this step reads nothing back from the device (with one process). With ScaledAdam or --use-fp16 the
    decision is read here; under DDP, whether the rank's batch has a finite loss. Under --use-fp16 a
    non-finite norm is the loss scaler's overflow: the scaler skips the update and halves its
    scale, counted in ``params.scaler_backoffs``, not as a skipped step.
    Returns (info: the batch's sums, pre-clip grad norm, clip scale), all 0-dim device tensors.
    """
    params, optimizer, scaler = t.params, t.optimizer, t.scaler
    if decided_on_device(t):
        out = step_on_device(t, inputs) if t.graphs is None else t.graphs.run(step_on_device, t, inputs)
        count = out.skipped.to(torch.int64)
        t.skipped_on_device = count if t.skipped_on_device is None else t.skipped_on_device + count
        t.outcomes.append(
            StepOutcome(
                params.batch_idx_train,
                out.info["dropped_utterances"],
                out.finite,
                inputs.cut_ids,
                out.skipped,
                out.grad_norm,
                out.utterances,
            )
        )
        return out.info, out.grad_norm, out.clip_scale
    info, finite = _forward_backward(t, inputs)
    grad_norm, clip_scale = t.grad_control.clip(t.model)
    t.outcomes.append(StepOutcome(params.batch_idx_train, info["dropped_utterances"], finite, inputs.cut_ids))
    kept, norm = read_scalars([summed_over_ranks(info["utterances"]), grad_norm])
    if scaler is not None and not math.isfinite(norm) and kept > 0:
        params.scaler_backoffs += 1
        optimizer.zero_grad(set_to_none=True)
        scaler.update()  # unscale_ recorded the inf/NaN: the scale is halved
    elif not math.isfinite(norm) or kept == 0:
        reason = "no utterance with a finite loss" if kept == 0 else f"gradient norm is {norm}"
        log_skip(params, params.batch_idx_train, reason)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()
    else:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return info, grad_norm, clip_scale


def step_on_device(t: Training, inputs: LossInputs) -> DeviceStep:
    """The step of :func:`device_step` decided on the device (Eve; float32 or bfloat16), what a CUDA graph
    captures (:mod:`icefall_lite.train.cuda_graphs`): no host read and no Python state changed but
    the model's, the optimizer's and the gradient controls' tensors."""
    info, finite = _forward_backward(t, inputs)
    grad_norm, clip_scale = t.grad_control.clip(t.model)
    # One decision for every DDP rank: the utterances with a finite loss of all ranks (the gradient norm is
    # already the same on every rank after DDP's all-reduce).
    utterances = summed_over_ranks(info["utterances"])
    skipped = ~torch.isfinite(grad_norm) | (utterances == 0)
    t.optimizer.step(found_inf=skipped)  # Eve masks its update where the step is skipped
    t.optimizer.zero_grad(set_to_none=True)
    return DeviceStep(info, grad_norm, clip_scale, finite, skipped, utterances)


def _forward_backward(t: Training, inputs: LossInputs) -> Tuple[MetricsTracker, torch.Tensor]:
    """The batch's loss and its backward (through the loss scaler with --use-fp16, its gradients unscaled):
    the sums and the utterances with a finite loss."""
    params, model, scaler = t.params, t.model, t.scaler
    warmup = params.batch_idx_train / params.model_warm_step
    with mixed_precision(params, next(model.parameters()).device):
        loss, info, finite = batch_loss(params, model, inputs, is_training=True, warmup=warmup)
    if (t.world_size > 1 or not decided_on_device(t)) and read_scalars([info["utterances"]])[0] == 0:
        # A batch without a finite loss: a backward through a zero that touches every parameter, whose
        # gradients are zeros (the masked loss's backward could give NaN). Under DDP the rank still takes part
        # in the gradient all-reduce, and its NaN would reach the ranks that have a step to take; the loss
        # scaler would count the NaN as an overflow and halve its scale. A read per step on those paths only.
        loss = sum(p.sum() * 0.0 for p in model.parameters())
    if scaler is not None:
        scaled = scaler.scale(loss)
        # The loss scale of this backward, for the filter statistics: a copy on the device (no sync), since
        # scaler.update() changes the scaler's own tensor in place.
        t.loss_scale = scaler._get_scale_async().clone()
        scaled.backward()
        scaler.unscale_(t.optimizer)
    else:
        loss.backward()
    return info, finite


@dataclass(frozen=True)
class LayerFilterStats:
    """One encoder layer's GradientFilter statistics of the last backward, as 0-dim device tensors
    (:class:`icefall_lite.nn.clip.GradientFilterStats`); ``median_norm`` in unscaled gradient units."""

    layer: int
    median_norm: torch.Tensor
    max_over_median: torch.Tensor
    fraction_filtered: torch.Tensor
    param_scale: torch.Tensor
    ratio: torch.Tensor  # (N,): each sequence's gradient RMS over the median (not a TensorBoard scalar)

    STATS = ("median_norm", "max_over_median", "fraction_filtered", "param_scale")


def filter_stats(model: nn.Module, loss_scale: Optional[torch.Tensor] = None) -> List[LayerFilterStats]:
    """Per-layer GradientFilter statistics of the last backward (none before the first), without a device sync.

    ``loss_scale``: the GradScaler's scale of that backward (--use-fp16), which
    multiplied every gradient the filters saw: the median norm is divided by it
    (the ratios are unchanged by a common scale).
    """
    out = []
    for layer, grad_filter in unwrap(model).encoder.gradient_filters():
        stats = grad_filter.stats
        if stats.num_backward == 0:
            continue
        median = stats.median_norm if loss_scale is None else stats.median_norm / loss_scale.to(stats.median_norm)
        out.append(
            LayerFilterStats(
                layer, median, stats.max_over_median, stats.fraction_filtered, stats.param_scale, stats.ratio
            )
        )
    return out


def batch_digest(batch: Dict[str, Any]) -> Optional[int]:
    """A 24-bit digest of the batch's cut ids, in order (exact as a TensorBoard float32 scalar); None when
    the batch carries no cuts (``--return-cuts false``)."""
    cuts = batch["supervisions"].get("cut")
    if not cuts:
        return None
    return zlib.crc32("\n".join(c.id for c in cuts).encode()) & 0xFFFFFF


def log_step(
    t: Training,
    batch: Dict[str, Any],
    info: MetricsTracker,
    grad_norm: float,
    clip_scale: float,
    stats: List[LayerFilterStats],
) -> None:
    """The step's TensorBoard scalars: losses per frame, learning rate, gradient norm and clip scale,
    skipped steps, the filter statistics, the recurrent cap's fraction of rows capped (--recurrent-grad-clip),
    the error clip's fraction of elements clipped (--error-clip) and the batch digest (the second moment's come with
    :meth:`Training.flush_log`)."""
    if t.tb_writer is None:
        return
    digest = batch_digest(batch)
    if digest is not None:
        t.add_scalar(TB_TAGS.batch_digest, digest)
    for key in ("loss", "simple_loss", "pruned_loss", "ctc_loss"):
        if key in info:  # not written for a batch without a kept utterance (no frames)
            t.add_scalar(getattr(TB_TAGS, key), info[key] / info["frames"], when=info["frames"] > 0)
    t.add_scalar(TB_TAGS.learning_rate, t.scheduler.get_last_lr()[0])
    t.add_scalar(TB_TAGS.grad_norm, grad_norm)
    t.add_scalar(TB_TAGS.clip_scale, clip_scale)
    if isinstance(t.optimizer, ScaledAdam):
        t.add_scalar(TB_TAGS.optimizer_clip_scale, t.optimizer.last_clipping_scale)
    t.add_scalar(TB_TAGS.skipped_steps, t.skipped_steps())
    for layer_stats in stats:
        for stat in LayerFilterStats.STATS:
            t.add_scalar(TB_TAGS.filter_tag(layer_stats.layer, stat), getattr(layer_stats, stat))
    for i, layer in enumerate(unwrap(t.model).encoder.encoder.layers):
        fraction = layer.lstm.recurrent_clip_stats.fraction_clipped  # None unless the cap is on
        if fraction is not None:
            t.add_scalar(TB_TAGS.recurrent_clip.format(layer=i), fraction)
    for i, counts in enumerate(t.grad_control.error_clip_counts):
        if counts.fraction_clipped is not None:
            t.add_scalar(TB_TAGS.error_clip.format(layer=i), counts.fraction_clipped)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def compute_validation_loss(
    params: AttributeDict, model: nn.Module, sp: spm.SentencePieceProcessor, valid_dl, world_size: int
) -> MetricsTracker:
    """The loss over ``valid_dl`` at full loss weights, summed over every DDP rank."""
    model.eval()
    tot = MetricsTracker()
    with torch.no_grad():
        for batch in valid_dl:
            _, info = compute_loss(params, model, sp, batch, is_training=False)
            tot = tot + info
    if world_size > 1:
        tot.reduce(next(model.parameters()).device)
    model.train()
    return tot


def validate(t: Training) -> MetricsTracker:
    """The validation loss: logged, written to TensorBoard, kept in ``params.valid_loss`` and, when it is the
    best so far, in ``params.best_valid_loss``/``best_valid_epoch`` (which epoch-N.pt becomes best-valid-loss.pt)."""
    params = t.params
    valid_info = compute_validation_loss(params, t.model, t.sp, t.valid_dl, t.world_size)
    params.valid_loss = valid_info.per_frame("loss")
    if params.valid_loss < params.best_valid_loss:
        params.best_valid_loss = params.valid_loss
        params.best_valid_epoch = params.cur_epoch
    t.add_scalar(TB_TAGS.valid_loss, params.valid_loss)
    return valid_info


# --------------------------------------------------------------------------
# Epochs
# --------------------------------------------------------------------------


def budget_spent(params: AttributeDict) -> bool:
    """Whether --max-batches or --max-minutes says training is over.

    Under DDP every rank measures its own clock: with --max-minutes the ranks decide together (a collective:
    every rank calls this at the same point), and all stop once any rank's clock is past the limit.
    """
    minutes_spent = params.max_minutes > 0 and params.train_seconds >= 60.0 * params.max_minutes
    if params.max_minutes > 0:
        minutes_spent = any_rank(minutes_spent)
    return (params.max_batches > 0 and params.batch_idx_train >= params.max_batches) or minutes_spent


def train_one_epoch(t: Training, train_dl, rng_state: Optional[Dict[str, Any]] = None) -> bool:
    """Train one epoch; returns False when --max-batches, --max-minutes or --print-diagnostics stopped it.

    ``rng_state``: the generators' states of a run resumed mid-epoch, restored
    once the loader has drawn its seed (as in the uninterrupted run).
    ``params.train_loss`` is set to the running training loss per frame at the end.
    """
    params = t.params
    if budget_spent(params):
        # Resumed at the end of the budget (a run killed between its last checkpoint and the final
        # validation): no more steps; the caller validates and saves.
        logging.info(f"Global batch {params.batch_idx_train}: the --max-batches/--max-minutes budget is spent")
        params.train_loss = params.get("train_loss", float("nan"))
        return False
    t.model.train()
    tot_loss = MetricsTracker()
    iterator = iter(train_dl)
    if rng_state is not None:
        set_rng_state(rng_state, train_dl)
    progress = progress_bar(
        iterator,
        desc=f"epoch {params.cur_epoch}",
        disable=t.rank != 0,
        dynamic_ncols=True,
        initial=params.batch_idx_in_epoch,
        unit="batch",
    )
    last_time = time.time()
    for batch in progress:
        params.batch_idx_train += 1
        params.batch_idx_in_epoch += 1
        info, grad_norm, clip_scale = train_step(t, batch)
        # A loss-scale overflow (--use-fp16) leaves the filters' statistics non-finite: not logged.
        stats = filter_stats(t.model, t.loss_scale) if t.scaler is None or math.isfinite(grad_norm) else []
        if t.sequence_log is not None and stats:
            cuts = batch["supervisions"]["cut"]
            t.sequence_log.add(params.batch_idx_train, [c.id for c in cuts], [s.ratio for s in stats])
        if t.second_moment is not None:
            t.second_moment.record(params.batch_idx_train)
        if t.diagnostics is not None and params.batch_idx_in_epoch >= DIAGNOSTICS_BATCHES:
            t.flush_log()  # the steps' dropped utterances and skips, logged
            t.diagnostics.print_diagnostics()
            return False
        if t.model_avg is not None and params.batch_idx_train % params.average_period == 0:
            update_averaged_model(params.average_period, params.batch_idx_train, t.model, t.model_avg)
        tot_loss = tot_loss * (1 - 1 / params.reset_interval) + info
        log_step(t, batch, info, grad_norm, clip_scale, stats)
        lr = t.scheduler.get_last_lr()[0]
        if params.batch_idx_train % params.log_interval == 0:  # the step's device values read here only
            t.flush_log()
            tot, info = read_metrics(tot_loss), read_metrics(info)
            fractions = [s.fraction_filtered for s in stats]
            grad_norm, clip_scale, *filtered = read_scalars([grad_norm, clip_scale, *fractions])
            if t.rank == 0:
                progress.set_postfix(
                    loss=f"{tot.per_frame('loss'):.3f}", lr=f"{lr:.2e}", gnorm=f"{grad_norm:.3g}", refresh=False
                )
            backoffs = f", loss-scale back-offs: {params.scaler_backoffs}" if params.use_fp16 else ""
            logging.info(
                f"Epoch {params.cur_epoch}, batch {params.batch_idx_in_epoch}, global batch {params.batch_idx_train}, "
                f"loss[{info.per_frame_str()}], tot_loss[{tot.per_frame_str()}], "
                f"batch size: {len(batch['supervisions']['text'])}, lr: {lr:.2e}, grad_norm: {grad_norm:.3g}, "
                f"clip_scale: {clip_scale:.3g}, filtered: {(sum(filtered) / len(filtered)) if filtered else 0.0:.3f}, "
                f"skipped steps: {params.skipped_steps}{backoffs}"
            )
        batch_idx = params.batch_idx_in_epoch - 1  # icefall's 0-based index in the epoch
        if params.valid_interval > 0 and batch_idx > 0 and batch_idx % params.valid_interval == 0:
            valid_info = validate(t)
            logging.info(
                f"Epoch {params.cur_epoch}, global batch {params.batch_idx_train}, validation: "
                f"{valid_info.per_frame_str()}"
            )
        if params.save_every_n > 0 and params.batch_idx_train % params.save_every_n == 0:
            t.save(params.exp_dir / f"checkpoint-{params.batch_idx_train}.pt", train_dl)
            if t.rank == 0:
                remove_checkpoints(params.exp_dir, params.keep_last_k)
        now = time.time()
        params.train_seconds += now - last_time
        last_time = now
        if budget_spent(params):
            progress.close()
            t.flush_log()
            params.train_loss = read_metrics(tot_loss).per_frame("loss")
            return False
    progress.close()
    t.flush_log()
    params.train_loss = read_metrics(tot_loss).per_frame("loss")
    if params.train_loss < params.best_train_loss:
        params.best_train_epoch = params.cur_epoch
        params.best_train_loss = params.train_loss
    return True


def stop_early(t: Training, train_dl) -> None:
    """Validate, log and save ``checkpoint-<batch>.pt`` when --max-batches or --max-minutes stopped training.

    The checkpoint keeps the RNG states of the stop, as if no validation had
    run, so that a run resumed from it continues as the uninterrupted one.
    """
    params = t.params
    rng_at_stop = get_rng_state(train_dl)
    valid_info = compute_validation_loss(params, t.model, t.sp, t.valid_dl, t.world_size)
    set_rng_state(rng_at_stop, train_dl)
    params.valid_loss = valid_info.per_frame("loss")
    logging.info(
        f"Stopped by --max-batches {params.max_batches} / --max-minutes {params.max_minutes} at global "
        f"batch {params.batch_idx_train} after {params.train_seconds:.1f} s of training: train loss "
        f"{params.train_loss:.4f}, validation: {valid_info.per_frame_str()}; saving and stopping."
    )
    t.add_scalar(TB_TAGS.valid_loss, params.valid_loss)
    t.save(params.exp_dir / f"checkpoint-{params.batch_idx_train}.pt", train_dl)


def finish_epoch(t: Training, epoch: int, epoch_start: float) -> None:
    """Validate, log, save ``epoch-<epoch>.pt`` and copy it to the best-loss checkpoints it beats."""
    params = t.params
    if params.valid_interval > 0:
        # icefall's rule: validation every --valid-interval batches only.
        valid_text = (
            f"last validation loss {params.get('valid_loss', float('nan')):.4f} (every {params.valid_interval} batches)"
        )
    else:
        valid_text = f"validation: {validate(t).per_frame_str()}"
    logging.info(
        f"Epoch {epoch} done in {time.time() - epoch_start:.1f} s: train loss {params.train_loss:.4f}, "
        f"{valid_text}, skipped steps {params.skipped_steps}, dropped utterances {params.skipped_utterances}"
    )
    t.add_scalar(TB_TAGS.epoch_train_loss, params.train_loss)
    params.batch_idx_in_epoch = 0
    filename = params.exp_dir / f"epoch-{epoch}.pt"
    t.save(filename, None)
    if t.rank == 0:
        if params.best_train_epoch == epoch:
            shutil.copyfile(filename, params.exp_dir / "best-train-loss.pt")
        if params.best_valid_epoch == epoch:
            shutil.copyfile(filename, params.exp_dir / "best-valid-loss.pt")


def epoch_dataloader(librispeech: LibriSpeechAsrDataModule, train_cuts, epoch: int, sampler_state: Optional[Dict]):
    """The training dataloader of ``epoch``, at the resumed sampler position if there is one."""
    train_dl = librispeech.train_dataloaders(train_cuts)
    train_dl.sampler.set_epoch(epoch - 1)
    if sampler_state is not None:
        train_dl.sampler.load_state_dict(sampler_state)
    return train_dl


def train_epochs(t: Training, librispeech: LibriSpeechAsrDataModule, train_cuts, resume: Optional[Resumption]) -> None:
    """Epochs ``params.cur_epoch .. --num-epochs``, or until --max-batches/--max-minutes/--print-diagnostics stop."""
    params = t.params
    for epoch in range(params.cur_epoch, params.num_epochs + 1):
        params.cur_epoch = epoch
        t.scheduler.step_epoch(epoch - 1)
        fix_random_seed(params.seed + epoch - 1)
        position = resume.take_epoch_position(params) if resume is not None else None
        if position is None:
            params.batch_idx_in_epoch = 0
        sampler_state, rng_state = position if position is not None else (None, None)
        train_dl = epoch_dataloader(librispeech, train_cuts, epoch, sampler_state)
        t.add_scalar(TB_TAGS.epoch, epoch)
        epoch_start = time.time()
        finished = train_one_epoch(t, train_dl, rng_state=rng_state)
        if t.diagnostics is not None:
            logging.info("Diagnostics printed; exiting (--print-diagnostics).")
            return
        if not finished:
            stop_early(t, train_dl)
            return
        finish_epoch(t, epoch, epoch_start)
