"""The TensorBoard tags of training, one home for the writer and the readers.

The training loop (:mod:`icefall_lite.train.loop`) writes its scalars under
these tags; the recipe's studies (the ablation, the learning-speed study) read
them back through the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class TrainingScalarTags:
    """The TensorBoard tags of the scalars training writes, by what they hold.

    ``grad_filter`` is a format string with ``{layer}`` and ``{stat}``
    (per-layer GradientFilter statistics, e.g. ``stat = "fraction_filtered"``).
    ``recurrent_clip`` (``{layer}``): the fraction of frame rows whose recurrent derivative
    ``--recurrent-grad-clip`` capped in the step's backward; ``error_clip`` (``{layer}``): the fraction of
    the layer output's gradient elements ``--error-clip`` clipped.
    ``batch_digest``: a 24-bit digest of the batch's cut ids (two runs saw the
    same batches when their digests agree step by step); ``exp_avg_sq_jump``
    and ``exp_avg_sq_recovery``: :mod:`icefall_lite.train.optimizer_state`'s
    jump of each step and the recovery steps of the events that ended at it.
    """

    loss: str
    simple_loss: str
    pruned_loss: str
    ctc_loss: str
    learning_rate: str
    grad_norm: str
    clip_scale: str
    optimizer_clip_scale: str
    skipped_steps: str
    valid_loss: str
    epoch: str
    epoch_train_loss: str
    grad_filter: str
    recurrent_clip: str
    error_clip: str
    batch_digest: str
    exp_avg_sq_jump: str
    exp_avg_sq_recovery: str

    def filter_tag(self, layer: int, stat: str) -> str:
        """The tag of GradientFilter statistic ``stat`` of encoder layer ``layer``."""
        return self.grad_filter.format(layer=layer, stat=stat)

    def parse_filter_tag(self, tag: str) -> Optional[Tuple[int, str]]:
        """``(layer, stat)`` of a GradientFilter tag, None for any other tag."""
        pattern = (
            re.escape(self.grad_filter).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{stat\}", r"(?P<stat>\w+)")
        )
        match = re.fullmatch(pattern, tag)
        return None if match is None else (int(match.group("layer")), match.group("stat"))


TB_TAGS = TrainingScalarTags(
    loss="train/loss",
    simple_loss="train/simple_loss",
    pruned_loss="train/pruned_loss",
    ctc_loss="train/ctc_loss",
    learning_rate="train/learning_rate",
    grad_norm="train/grad_norm",
    clip_scale="train/clip_scale",
    optimizer_clip_scale="train/optimizer_clip_scale",
    skipped_steps="train/skipped_steps",
    valid_loss="train/valid_loss",
    epoch="train/epoch",
    epoch_train_loss="train/epoch_train_loss",
    grad_filter="grad_filter/layer{layer}/{stat}",
    recurrent_clip="recurrent_clip/layer{layer}/fraction_clipped",
    error_clip="error_clip/layer{layer}/fraction_clipped",
    batch_digest="train/batch_digest",
    exp_avg_sq_jump="optim/exp_avg_sq_jump",
    exp_avg_sq_recovery="optim/exp_avg_sq_recovery_steps",
)
