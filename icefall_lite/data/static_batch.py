"""A training step's inputs as tensors, and their padding to a static shape.

A lhotse batch becomes :class:`BatchTensors` (features, frame counts, token ids padded with their counts, which
rows are real) once, on the host, pinned when CUDA is there, so that the step copies it to the device
asynchronously and reads nothing back. :func:`pad_to` pads it to one of the few shapes :func:`static_shape`
picks (a CUDA graph is captured per shape): dummy rows are marked not real, and the model gives them zero loss
and leaves them, like the extra frames, out of its training statistics (:class:`icefall_lite.nn.model.Transducer`),
so a padded batch gives the batch's losses and gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Tuple

import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import Tensor

from icefall_lite.data.features import LOG_EPS
from icefall_lite.nn.model import token_id_tensors

# Static shapes (see static_shape). Frames: a multiple of 128 input frames (1.28 s at lhotse's 10 ms shift; 32
# encoder frames after 4x subsampling): LibriSpeech's cuts (up to 35 s) fall in under 30 sizes, and the padding
# is under 13% of a 10-s batch. The step's time grows with the frames (the LSTM launches kernels per frame), so
# the frames are rounded finely. Tokens: a multiple of 32 (at BPE 500 LibriSpeech's longest transcripts are near
# 100 tokens: a few sizes, which follow the frames).
FRAME_MULTIPLE = 128
TOKEN_MULTIPLE = 32


@dataclass(frozen=True)
class BatchTensors:
    """One batch as the training step takes it; every field has the batch (N rows) first.

    features: (N, T, F) float, padded with log(1e-10) as lhotse pads.
    feature_lens: (N,) int64 frames of each row.
    tokens: (N, U) int64 token ids (no blank), 0 after each row's length.
    token_lens: (N,) int64.
    real: (N,) bool, False for a dummy row added by :func:`pad_to`.
    """

    features: Tensor
    feature_lens: Tensor
    tokens: Tensor
    token_lens: Tensor
    real: Tensor

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(rows, frames, tokens)."""
        return self.features.size(0), self.features.size(1), self.tokens.size(1)

    def pin_memory(self) -> "BatchTensors":
        """Every tensor in pinned host memory (a padded batch is in pageable memory, whose copy to the GPU
        waits for the host)."""
        return BatchTensors(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    def to(self, device: torch.device) -> "BatchTensors":
        """Every tensor on ``device``; asynchronous from pinned host memory."""
        return BatchTensors(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def batch_tensors(batch: Dict[str, Any], sp: spm.SentencePieceProcessor) -> BatchTensors:
    """A lhotse batch (``inputs`` (N, T, F), ``supervisions`` with ``num_frames`` and ``text``, one
    supervision per cut) -> its :class:`BatchTensors` on the host, every row real.

    The token tensors are pinned when CUDA is available (the loader pins the features then), so their copy
    to the GPU is asynchronous.
    """
    supervisions = batch["supervisions"]
    tokens, token_lens = token_id_tensors(sp.encode(list(supervisions["text"]), out_type=int))
    real = torch.ones(tokens.size(0), dtype=torch.bool)
    if torch.cuda.is_available():
        tokens, token_lens, real = tokens.pin_memory(), token_lens.pin_memory(), real.pin_memory()
    return BatchTensors(batch["inputs"], supervisions["num_frames"], tokens, token_lens, real)


def _round_up(n: int, multiple: int) -> int:
    return max(1, math.ceil(n / multiple)) * multiple


def static_shape(rows: int, frames: int, tokens: int) -> Tuple[int, int, int]:
    """The static shape (rows, frames, tokens) a batch of this shape is padded to.

    Rows: the next power of two. The sampler fills a batch up to --max-duration, so within a bucket the rows
    vary with the cuts' durations (and the epoch's last batches are short); powers of two make a handful of
    sizes. Padded rows cost little: on an H200 the icefall preset's step takes the same time at 20, 40, 80
    and 160 utterances of 10 s (launch-bound; measured for issue 74), memory grows with them. Frames and
    tokens: the next multiple of :data:`FRAME_MULTIPLE` and :data:`TOKEN_MULTIPLE`.
    """
    return 1 << max(0, rows - 1).bit_length(), _round_up(frames, FRAME_MULTIPLE), _round_up(tokens, TOKEN_MULTIPLE)


def pad_to(batch: BatchTensors, shape: Tuple[int, int, int]) -> BatchTensors:
    """``batch`` padded to ``shape`` (rows, frames, tokens), each at least the batch's own.

    Extra frames are log(1e-10) (lhotse's padding), extra tokens 0. A dummy row is not real, has log(1e-10)
    features over all the frames and no token: the losses of such a row are finite (a lattice of every frame
    and no symbol), so its zero loss weight leaves every gradient as it was.
    """
    rows, frames, tokens = shape
    n, t, u = batch.shape
    if rows < n or frames < t or tokens < u:
        raise ValueError(f"cannot pad a batch of shape {batch.shape} to {shape}")
    extra = rows - n
    features = F.pad(batch.features, (0, 0, 0, frames - t, 0, extra), value=LOG_EPS)
    feature_lens = F.pad(batch.feature_lens, (0, extra), value=frames)
    return BatchTensors(
        features=features,
        feature_lens=feature_lens,
        tokens=F.pad(batch.tokens, (0, tokens - u, 0, extra), value=0),
        token_lens=F.pad(batch.token_lens, (0, extra), value=0),
        real=F.pad(batch.real, (0, extra), value=False),
    )
