"""Transducer joiner: ``output_linear(tanh(encoder_proj(e) + decoder_proj(d)))``."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.nn.scaling import ScaledLinear


class Joiner(nn.Module):
    """Combines encoder and decoder frames into logits over the vocabulary.

    ``encoder_proj`` and ``decoder_proj`` are separate so callers can project
    once and reuse (pruned loss, beam search): pass ``project_input=False``
    with already projected inputs.

    ``blank_penalty`` (a plain attribute, 0 unless a decoder sets it, as
    icefall's ``--blank-penalty``) is subtracted from the blank logit, so
    every search that calls the joiner emits tokens more readily.
    """

    def __init__(self, encoder_dim: int, decoder_dim: int, joiner_dim: int, vocab_size: int, blank_id: int) -> None:
        super().__init__()
        self.encoder_proj = ScaledLinear(encoder_dim, joiner_dim)
        self.decoder_proj = ScaledLinear(decoder_dim, joiner_dim)
        self.output_linear = ScaledLinear(joiner_dim, vocab_size)
        self.blank_id = blank_id
        self.blank_penalty = 0.0

    def forward(self, encoder_out: Tensor, decoder_out: Tensor, project_input: bool = True) -> Tensor:
        """
        Args:
          encoder_out: (..., encoder_dim), or (..., joiner_dim) if not ``project_input``.
          decoder_out: (..., decoder_dim), or (..., joiner_dim); broadcastable with encoder_out.
        Returns:
          logits (..., vocab_size).
        """
        if project_input:
            encoder_out = self.encoder_proj(encoder_out)
            decoder_out = self.decoder_proj(decoder_out)
        # One expression, so the sum is freed as soon as tanh has read it (on the
        # full lattice it is as large as the logits).
        logits = self.output_linear(torch.tanh(encoder_out + decoder_out))
        if self.blank_penalty != 0.0:
            logits[..., self.blank_id] -= self.blank_penalty
        return logits
