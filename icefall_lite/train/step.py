"""One training step: the host's part (:func:`prepare_step`), then forward, backward, clip and update decided on
the device (:func:`device_step`; :func:`step_on_device` is what a CUDA graph captures)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from icefall_lite.train.distributed import summed_over_ranks
from icefall_lite.train.loss import LossInputs, batch_loss, loss_inputs
from icefall_lite.train.step_log import read_scalars
from icefall_lite.train.training import StepOutcome, Training
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
    whether the step counts as skipped, the utterances kept on all ranks, and with --use-fp16 whether the
    loss scaler backed off (0-dim; None without it)."""

    info: MetricsTracker
    grad_norm: torch.Tensor
    clip_scale: torch.Tensor
    finite: torch.Tensor
    skipped: torch.Tensor
    utterances: torch.Tensor
    backoff: Optional[torch.Tensor] = None


def device_step(t: Training, inputs: LossInputs) -> Tuple[MetricsTracker, torch.Tensor, torch.Tensor]:
    """Forward, backward, clip and update on one batch (its inputs and learning rate from
    :func:`prepare_step`), decided on the device (:func:`step_on_device`, replayed as a CUDA graph with
    ``t.graphs``): with one process it reads nothing back from the device.

    A step whose gradient norm is not finite, or whose batch has no utterance
    with a finite loss, makes no update. It is counted in ``params.skipped_steps``
    and logged at :meth:`Training.flush_log` (``--log-interval``), as the dropped utterances are, except that
    under --use-fp16 a non-finite norm with a finite loss is the loss scaler's overflow: its scale is halved,
    counted in ``params.scaler_backoffs``, not as a skipped step.
    Returns (info: the batch's sums, pre-clip grad norm, clip scale), all 0-dim device tensors.
    """
    params = t.params
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
            out.backoff,
        )
    )
    return out.info, out.grad_norm, out.clip_scale


def step_on_device(t: Training, inputs: LossInputs) -> DeviceStep:
    """The step of :func:`device_step`, what a CUDA graph captures (:mod:`icefall_lite.train.cuda_graphs`): no
    host read and no Python state changed but the model's, the optimizer's, the loss scaler's and the gradient
    controls' tensors."""
    info, finite = _forward_backward(t, inputs)
    grad_norm, clip_scale = t.grad_control.clip(t.model)
    # One decision for every DDP rank: the utterances with a finite loss of all ranks (the gradient norm is
    # already the same on every rank after DDP's all-reduce).
    utterances = summed_over_ranks(info["utterances"])
    overflow, kept = ~torch.isfinite(grad_norm), utterances > 0
    t.optimizer.step(found_inf=overflow | ~kept)  # the optimizer masks its update where the step is skipped
    t.optimizer.zero_grad(set_to_none=True)
    if t.scaler is None:
        return DeviceStep(info, grad_norm, clip_scale, finite, overflow | ~kept, utterances)
    t.scaler.update()  # from the overflow unscale_ recorded: the scale halved, or its growth counted
    return DeviceStep(info, grad_norm, clip_scale, finite, ~kept, utterances, overflow & kept)


def _forward_backward(t: Training, inputs: LossInputs) -> Tuple[MetricsTracker, torch.Tensor]:
    """The batch's loss and its backward (through the loss scaler with --use-fp16, its gradients unscaled):
    the sums and the utterances with a finite loss.

    A batch without a finite loss back-propagates zeros (the masked loss's backward could give NaN): under the
    loss scaler no overflow is counted for it (its scale is not halved). Under DDP the rank's count is read
    and the zero is a backward through every parameter, since the rank still takes part in the gradient
    all-reduce and its NaN would reach the ranks that have a step to take; with one process the gradients
    are set to zero on the device."""
    params, model, scaler = t.params, t.model, t.scaler
    warmup = params.batch_idx_train / params.model_warm_step
    with mixed_precision(params, next(model.parameters()).device):
        loss, info, finite = batch_loss(params, model, inputs, is_training=True, warmup=warmup)
    if t.world_size > 1 and read_scalars([info["utterances"]])[0] == 0:
        loss = sum(p.sum() * 0.0 for p in model.parameters())
    if scaler is not None:
        scaled = scaler.scale(loss)
        # The loss scale of this backward, for the filter statistics: a copy on the device (no sync), since
        # scaler.update() changes the scaler's own tensor in place.
        t.loss_scale = scaler._get_scale_async().clone()
        scaled.backward()
        if t.world_size == 1:
            kept = info["utterances"] > 0
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.copy_(torch.where(kept, p.grad, torch.zeros((), dtype=p.grad.dtype, device=p.device)))
        scaler.unscale_(t.optimizer)
    else:
        loss.backward()
    return info, finite
