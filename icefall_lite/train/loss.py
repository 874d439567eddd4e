"""The training objective: the loss weights' warm-up ramp and the loss of one batch."""

from __future__ import annotations

import logging
from typing import Any, Dict, Mapping, Optional, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn

from icefall_lite.data.features import pad_tail
from icefall_lite.data.static_batch import batch_tensors
from icefall_lite.nn.encoder import subsampled_length
from icefall_lite.train.step_log import read_scalars
from icefall_lite.utils import MetricsTracker

LOSS_RAMPS = ("step", "linear")


def pruned_loss_scale(warmup: float) -> float:
    """icefall's ramp: 0 during the first warm-up, 0.1 during the second, then 1.

    As icefall's, ``warmup == 1.0`` exactly gives 1.0: the validation loss
    (computed at warmup 1.0) is ``simple_loss_scale * simple + pruned``.
    """
    if warmup < 1.0:
        return 0.0
    if 1.0 < warmup < 2.0:
        return 0.1
    return 1.0


def loss_scales(params: Mapping[str, Any], warmup: float) -> Tuple[float, float]:
    """(simple, pruned) loss weights at ``warmup`` (batches / --model-warm-step) under ``params.loss_ramp``.

    ``step`` is lstm_transducer_stateless3's (:func:`pruned_loss_scale`, simple
    at ``simple_loss_scale`` throughout); ``linear`` is the zipformer recipes'
    (simple 1.0 -> ``simple_loss_scale`` and pruned 0.1 -> 1.0 over the warm-up).
    """
    if params["loss_ramp"] == "linear":
        if warmup >= 1.0:
            return params["simple_loss_scale"], 1.0
        return 1.0 - warmup * (1.0 - params["simple_loss_scale"]), 0.1 + 0.9 * warmup
    return params["simple_loss_scale"], pruned_loss_scale(warmup)


def delay_penalty_at(params: Mapping[str, Any], warmup: float) -> float:
    """--delay-penalty as icefall's lstm_transducer_stateless3 applies it: only once ``warmup >= 2``
    (after both warm-up phases), so never in validation (computed at warmup 1.0)."""
    return params["delay_penalty"] if warmup >= 2.0 else 0.0


def compute_loss(
    params: Mapping[str, Any],
    model: nn.Module,
    sp: spm.SentencePieceProcessor,
    batch: Dict[str, Any],
    is_training: bool,
    warmup: float = 1.0,
) -> Tuple[Optional[torch.Tensor], MetricsTracker]:
    """Per-utterance summed loss over the batch.

    The objective is ``simple_scale * simple + pruned_scale * pruned +
    ctc_loss_scale * ctc`` with the first two weights from
    :func:`loss_scales`; ``info["loss"]`` holds its transducer part (the
    first two terms) and ``info["ctc_loss"]`` the CTC loss. Loss per frame
    counts the frames of the utterances, not the tail padding
    (``tail_pad_frames``). Utterances whose loss is not finite are dropped
    and counted. Returns ``(None, info)`` when no utterance is left.

    Args:
      params: ``tail_pad_frames``, ``prune_range``, ``am_scale``, ``lm_scale``,
        ``loss_ramp``, ``simple_loss_scale``, ``ctc_loss_scale``, ``delay_penalty``.
      batch: a lhotse batch: ``inputs`` (N, T, C) and ``supervisions``; the model takes it as
        :class:`icefall_lite.data.static_batch.BatchTensors`.
      warmup: training progress in units of the model warm-up (1.0 = warmed up).
    """
    device = next(model.parameters()).device
    host = batch_tensors(batch, sp)
    # Asynchronous copies from pinned memory on CUDA (a no-op on the CPU).
    inputs = host.to(device)
    feature, feature_lens = inputs.features, inputs.feature_lens
    num_frames = feature_lens
    if params["tail_pad_frames"] > 0:
        feature, feature_lens = pad_tail(feature, feature_lens, params["tail_pad_frames"])
    supervisions = batch["supervisions"]
    with torch.set_grad_enabled(is_training):
        simple_loss, pruned_loss, ctc_loss, _ = model(
            x=feature,
            x_lens=feature_lens,
            y=inputs.tokens,
            y_lens=inputs.token_lens,
            real=inputs.real,
            prune_range=params["prune_range"],
            am_scale=params["am_scale"],
            lm_scale=params["lm_scale"],
            warmup=warmup,
            delay_penalty=delay_penalty_at(params, warmup),
        )
        is_finite = torch.isfinite(simple_loss) & torch.isfinite(pruned_loss)
        if ctc_loss is not None:
            is_finite &= torch.isfinite(ctc_loss)
        finite = is_finite.tolist()  # the one read before the sums: which utterances are kept
        num_dropped = finite.count(False)
        info = MetricsTracker()
        info["utterances"] = float(len(finite) - num_dropped)
        info["dropped_utterances"] = float(num_dropped)
        if num_dropped:
            cuts = supervisions.get("cut", [])
            cut_ids = [c.id for c, ok in zip(cuts, finite) if not ok]
            logging.warning(f"Dropping {num_dropped} utterance(s) with non-finite loss: {cut_ids}")
        if num_dropped == len(finite):
            return None, info

        def kept(x: torch.Tensor) -> torch.Tensor:
            # Boolean indexing waits for the device; without a dropped utterance there is nothing to index.
            return x[is_finite] if num_dropped else x

        simple_loss = kept(simple_loss).sum()
        pruned_loss = kept(pruned_loss).sum()
        simple_scale, pruned_scale = loss_scales(params, warmup)
        loss = simple_scale * simple_loss + pruned_scale * pruned_loss
        sums = {"loss": loss.detach(), "simple_loss": simple_loss.detach(), "pruned_loss": pruned_loss.detach()}
        if ctc_loss is not None:
            ctc_loss = kept(ctc_loss).sum()
            sums["ctc_loss"] = ctc_loss.detach()
            loss = loss + params["ctc_loss_scale"] * ctc_loss
    sums["frames"] = subsampled_length(kept(num_frames)).sum()
    for key, value in zip(sums, read_scalars(list(sums.values()))):  # one device-to-host transfer
        info[key] = value
    return loss, info
