"""Stateless prediction network: an embedding of the last ``context_size`` tokens."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from icefall_lite.nn.scaling import ScaledConv1d, ScaledEmbedding


class Decoder(nn.Module):
    """Embedding + depthwise Conv1d over the last ``context_size`` tokens + ReLU.

    Negative token ids (the ``-1`` that pads the initial context
    ``[-1] * (context_size - 1) + [blank_id]``) embed to zero. ``blank_id`` is
    an ordinary row of the embedding, learned in training (no ``padding_idx``),
    as in icefall's ``lstm_transducer_stateless3``.

    Parameter names as icefall's: ``embedding.scale``, ``embedding.weight``
    and, for ``context_size > 1``, ``conv.weight``, ``conv.weight_scale``.

    Args:
      vocab_size: number of tokens, blank included.
      decoder_dim: embedding and output dimension.
      blank_id: id of the blank token.
      context_size: 1 = bigram (no conv), 2 = trigram (icefall's default).
    """

    def __init__(self, vocab_size: int, decoder_dim: int, blank_id: int, context_size: int) -> None:
        super().__init__()
        if context_size < 1:
            raise ValueError(f"context_size must be >= 1, got {context_size}")
        self.vocab_size = vocab_size
        self.decoder_dim = decoder_dim
        self.blank_id = blank_id
        self.context_size = context_size
        self.embedding = ScaledEmbedding(vocab_size, decoder_dim)
        self.conv = (
            ScaledConv1d(decoder_dim, decoder_dim, kernel_size=context_size, groups=decoder_dim, bias=False)
            if context_size > 1
            else None
        )

    def forward(self, y: Tensor, need_pad: bool = True) -> Tensor:
        """
        Args:
          y: (N, U) token ids; ``-1`` entries embed to zero.
          need_pad: True in training (left-pad so output frame u sees tokens
            ``u-context_size+1 .. u``); False in decoding, where ``U`` must equal
            ``context_size`` and one output frame is produced.
        Returns:
          (N, U, decoder_dim) when ``need_pad``, else (N, 1, decoder_dim).
        """
        y = y.to(torch.int64)
        embedding_out = self.embedding(y.clamp(min=0)) * (y >= 0).unsqueeze(-1)
        if self.conv is not None:
            if not need_pad:
                return F.relu(self._last_context_conv(embedding_out))
            embedding_out = F.pad(embedding_out.permute(0, 2, 1), pad=(self.context_size - 1, 0))
            embedding_out = self.conv(embedding_out).permute(0, 2, 1)
        return F.relu(embedding_out)

    def _last_context_conv(self, embedding_out: Tensor) -> Tensor:
        """The depthwise conv at its one output position, as a weighted sum over the context.

        Decoding calls the decoder once per emitted token; at that size a conv
        kernel call costs several times this sum (same result).

        Args:
          embedding_out: (N, context_size, decoder_dim).
        Returns:
          (N, 1, decoder_dim).
        """
        if embedding_out.size(1) != self.context_size:
            raise ValueError(
                f"Decoder without padding needs exactly context_size={self.context_size} tokens, "
                f"got {embedding_out.size(1)}"
            )
        conv = self.conv
        # (decoder_dim, 1, context_size); a plain nn.Conv1d after the ONNX export's scale folding
        weight = conv.get_weight() if isinstance(conv, ScaledConv1d) else conv.weight
        return (embedding_out * weight.squeeze(1).t()).sum(dim=1, keepdim=True)
