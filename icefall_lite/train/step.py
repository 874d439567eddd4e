"""One training step: the host's part (:func:`prepare_step`), then forward, backward, clip and update
(:func:`device_step`): decided on the device in float32 or bfloat16 (:func:`step_on_device`, what a CUDA graph
captures), read on the host with float16's loss scaler."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch

from icefall_lite.train.distributed import summed_over_ranks
from icefall_lite.train.loss import LossInputs, batch_loss, loss_inputs
from icefall_lite.train.step_log import read_scalars
from icefall_lite.train.training import StepOutcome, Training, log_skip
from icefall_lite.utils import AttributeDict, MetricsTracker


def mixed_precision(params: AttributeDict, device: torch.device) -> torch.autocast:
    """The autocast of a training step on ``device``: float16 with --use-fp16, bfloat16 with --use-bf16, else
    off (float32). Without autocast's cache of cast weights, which a CUDA graph's capture cannot keep (each
    weight is cast where it is used, once per step here)."""
    dtype = torch.float16 if params.use_fp16 else torch.bfloat16
    enabled = params.use_fp16 or params.use_bf16
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled, cache_enabled=False)


def train_step(t: Training, batch: Dict[str, Any]) -> Tuple[MetricsTracker, torch.Tensor, torch.Tensor]:
    """One training step on a lhotse batch (``t.params.batch_idx_train`` already counts it):
    :func:`prepare_step` on the host, then :func:`device_step`."""
    return device_step(t, prepare_step(t, batch))


def prepare_step(t: Training, batch: Dict[str, Any]) -> LossInputs:
    """The host's part of a step: the batch's :class:`LossInputs`, and Eden's learning rate of this update
    (as icefall: the rate of update b is Eden's at batch b), staged on the device for the optimizer before the step."""
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
    """Whether the step's skip is decided on the device: without a loss scaler (float32, bfloat16)."""
    return t.scaler is None


def device_step(t: Training, inputs: LossInputs) -> Tuple[MetricsTracker, torch.Tensor, torch.Tensor]:
    """Forward, backward, clip and update on one batch (its inputs and learning rate from
    :func:`prepare_step`).

    A step whose gradient norm is not finite, or whose batch has no utterance
    with a finite loss, is skipped: no update, counted in
    ``params.skipped_steps`` and logged. In float32 or bfloat16 the skip
    is decided on the device (:func:`step_on_device`, replayed as a CUDA graph with ``t.graphs``), and
    counted and logged at :meth:`Training.flush_log` (``--log-interval``), as the dropped utterances are: then
    this step reads nothing back from the device (with one process). With --use-fp16 the
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
    """The step of :func:`device_step` decided on the device (float32 or bfloat16), what a CUDA graph
    captures (:mod:`icefall_lite.train.cuda_graphs`): no host read and no Python state changed but
    the model's, the optimizer's and the gradient controls' tensors."""
    info, finite = _forward_backward(t, inputs)
    grad_norm, clip_scale = t.grad_control.clip(t.model)
    # One decision for every DDP rank: the utterances with a finite loss of all ranks (the gradient norm is
    # already the same on every rank after DDP's all-reduce).
    utterances = summed_over_ranks(info["utterances"])
    skipped = ~torch.isfinite(grad_norm) | (utterances == 0)
    t.optimizer.step(found_inf=skipped)  # the optimizer masks its update where the step is skipped
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
