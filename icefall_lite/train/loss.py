"""The training objective: the loss weights' warm-up ramp and the loss of one batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import sentencepiece as spm
import torch
import torch.nn as nn

from icefall_lite.data.features import pad_tail
from icefall_lite.data.static_batch import BatchTensors, batch_tensors
from icefall_lite.nn.encoder import subsampled_length
from icefall_lite.nn.rnnt_pruning import raised_s_range
from icefall_lite.train.step_log import read_metrics
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


@dataclass(frozen=True)
class LossInputs:
    """A batch as :func:`batch_loss` takes it, made on the host (nothing read from a device): its tensors, the
    pruned loss's window raised on the host's lengths (k2's raise, :func:`raised_s_range`) and the cut ids
    (named when an utterance's loss is not finite; empty with ``--return-cuts false``)."""

    tensors: BatchTensors
    prune_range: int
    cut_ids: List[str]


def loss_inputs(params: Mapping[str, Any], sp: spm.SentencePieceProcessor, batch: Dict[str, Any]) -> LossInputs:
    """A lhotse batch (``inputs`` (N, T, C) and ``supervisions``) -> its :class:`LossInputs`."""
    host = batch_tensors(batch, sp)
    encoder_frames = subsampled_length(host.feature_lens + max(params["tail_pad_frames"], 0))
    prune_range = raised_s_range(host.token_lens, encoder_frames, params["prune_range"])
    cuts = batch["supervisions"].get("cut") or []
    return LossInputs(host, prune_range, [c.id for c in cuts])


def batch_loss(
    params: Mapping[str, Any], model: nn.Module, inputs: LossInputs, is_training: bool, warmup: float = 1.0
) -> Tuple[torch.Tensor, MetricsTracker, torch.Tensor]:
    """The objective of one batch and its sums, on the model's device, reading nothing back.

    The objective is ``simple_scale * simple + pruned_scale * pruned +
    ctc_loss_scale * ctc`` over the utterances whose losses are finite, with the
    first two weights from :func:`loss_scales`. An utterance whose loss is not finite is left out by a mask,
    not by boolean indexing (which would wait for the device): its gradient is zero either way.

    Args:
      params: ``tail_pad_frames``, ``am_scale``, ``lm_scale``, ``loss_ramp``, ``simple_loss_scale``,
        ``ctc_loss_scale``, ``delay_penalty``.
      warmup: training progress in units of the model warm-up (1.0 = warmed up).
    Returns:
      loss: 0-dim (0 when no utterance is finite);
      sums: 0-dim float64 device tensors: ``loss`` (its transducer part, the first two terms), ``simple_loss``,
        ``pruned_loss``, ``ctc_loss`` (with a CTC head), ``frames`` (the encoder frames of the kept utterances,
        not the tail padding), ``utterances`` (kept) and ``dropped_utterances``;
      finite: (N,) bool, the rows with a finite loss (a padded batch's dummy rows last).
    """
    device = next(model.parameters()).device
    # Asynchronous copies from pinned memory on CUDA (a no-op on the CPU).
    x = inputs.tensors.to(device)
    feature, feature_lens = x.features, x.feature_lens
    num_frames = feature_lens
    if params["tail_pad_frames"] > 0:
        feature, feature_lens = pad_tail(feature, feature_lens, params["tail_pad_frames"])
    with torch.set_grad_enabled(is_training):
        simple_loss, pruned_loss, ctc_loss, _ = model(
            x=feature,
            x_lens=feature_lens,
            y=x.tokens,
            y_lens=x.token_lens,
            real=x.real,
            prune_range=inputs.prune_range,
            prune_range_raised=True,
            am_scale=params["am_scale"],
            lm_scale=params["lm_scale"],
            warmup=warmup,
            delay_penalty=delay_penalty_at(params, warmup),
        )
        finite = torch.isfinite(simple_loss) & torch.isfinite(pruned_loss)
        if ctc_loss is not None:
            finite &= torch.isfinite(ctc_loss)
        keep = finite & x.real  # a dummy row of a padded batch is not an utterance

        def kept(v: torch.Tensor) -> torch.Tensor:
            return torch.where(keep, v, 0).sum()

        simple_loss, pruned_loss = kept(simple_loss), kept(pruned_loss)
        simple_scale, pruned_scale = loss_scales(params, warmup)
        loss = simple_scale * simple_loss + pruned_scale * pruned_loss
        sums = {"loss": loss, "simple_loss": simple_loss, "pruned_loss": pruned_loss}
        if ctc_loss is not None:
            ctc_loss = kept(ctc_loss)
            sums["ctc_loss"] = ctc_loss
            loss = loss + params["ctc_loss_scale"] * ctc_loss
    sums["frames"] = kept(subsampled_length(num_frames))
    sums["utterances"] = keep.sum()
    sums["dropped_utterances"] = (x.real & ~finite).sum()
    info = MetricsTracker()
    for key, value in sums.items():
        info[key] = value.detach().to(torch.float64)
    return loss, info, finite


def warn_dropped(cut_ids: List[str], finite: torch.Tensor) -> None:
    """Log the utterances :func:`batch_loss` left out (a host read of ``finite``: call it where reading is
    due)."""
    kept = finite.tolist()
    if not all(kept):
        dropped = [c for c, ok in zip(cut_ids, kept) if not ok]
        logging.warning(f"Dropping {kept.count(False)} utterance(s) with non-finite loss: {dropped}")


def compute_loss(
    params: Mapping[str, Any],
    model: nn.Module,
    sp: spm.SentencePieceProcessor,
    batch: Dict[str, Any],
    is_training: bool,
    warmup: float = 1.0,
) -> Tuple[Optional[torch.Tensor], MetricsTracker]:
    """:func:`batch_loss` of a lhotse batch, its sums read as Python floats (one transfer) and the dropped
    utterances logged: ``(None, info)`` when no utterance is left. Validation's loss and the tools' (the
    training step reads at ``--log-interval`` only: :func:`icefall_lite.train.step.train_step`)."""
    inputs = loss_inputs(params, sp, batch)
    loss, sums, finite = batch_loss(params, model, inputs, is_training, warmup)
    info = read_metrics(sums)
    if info["dropped_utterances"]:
        warn_dropped(inputs.cut_ids, finite)
    return (loss if info["utterances"] > 0 else None), info
