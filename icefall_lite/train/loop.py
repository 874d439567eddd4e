"""The training loop: one epoch, the epochs of a run, what each step logs, validation and the checkpoints
they save (a run's objects: :class:`icefall_lite.train.training.Training`; one step:
:mod:`icefall_lite.train.step`)."""

from __future__ import annotations

import logging
import math
import shutil
import time
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import sentencepiece as spm
import torch
import torch.nn as nn

from icefall_lite.data.datamodule import LibriSpeechAsrDataModule
from icefall_lite.train.averaging import update_averaged_model
from icefall_lite.train.checkpoint import remove_checkpoints, unwrap
from icefall_lite.train.distributed import any_rank
from icefall_lite.train.loss import compute_loss
from icefall_lite.train.optim import ScaledAdam
from icefall_lite.train.resume import Resumption
from icefall_lite.train.rng import fix_random_seed, get_rng_state, set_rng_state
from icefall_lite.train.step import train_step
from icefall_lite.train.step_log import read_metrics, read_scalars
from icefall_lite.train.tb_tags import TB_TAGS
from icefall_lite.train.training import Training
from icefall_lite.utils import AttributeDict, MetricsTracker, progress_bar

DIAGNOSTICS_BATCHES = 5


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
    stats_valid: Optional[torch.Tensor] = None,
) -> None:
    """The step's TensorBoard scalars: losses per frame, learning rate, gradient norm and clip scale,
    skipped steps, the filter statistics (where ``stats_valid``, a device flag, is true, if given), the
    recurrent cap's fraction of rows capped (--recurrent-grad-clip), the error clip's fraction of elements
    clipped (--error-clip) and the batch digest (the second moment's come with :meth:`Training.flush_log`)."""
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
            t.add_scalar(TB_TAGS.filter_tag(layer_stats.layer, stat), getattr(layer_stats, stat), when=stats_valid)
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
        stats = filter_stats(t.model, t.loss_scale)
        # A loss-scale overflow (--use-fp16) leaves the filters' statistics non-finite: not logged (a device
        # flag; the sequence log reads it).
        stats_valid = None if t.scaler is None else torch.isfinite(grad_norm)
        if t.sequence_log is not None and (stats_valid is None or bool(stats_valid)):
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
        log_step(t, batch, info, grad_norm, clip_scale, stats, stats_valid)
        lr = t.scheduler.get_last_lr()[0]
        if params.batch_idx_train % params.log_interval == 0:  # the step's device values read here only
            t.flush_log()
            tot, info = read_metrics(tot_loss), read_metrics(info)
            fractions = [s.fraction_filtered for s in stats]
            grad_norm, clip_scale, *filtered = read_scalars([grad_norm, clip_scale, *fractions])
            if stats_valid is not None and not math.isfinite(grad_norm):
                filtered = []
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
