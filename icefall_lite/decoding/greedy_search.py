"""Greedy search: per utterance (up to ``max_sym_per_frame`` symbols per frame) and batched (one per frame).

Conventions (initial context, eval mode, sorting, blank/unk): :mod:`icefall_lite.decoding.search_utils`.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.decoding.search_utils import (
    DecoderFn,
    FrameSearch,
    JoinerFn,
    check_inputs,
    eval_mode,
    model_decoder_out,
    model_functions,
    model_initial_context,
    model_skip_ids,
    search_sorted,
)

# Maximum number of symbols emitted in one utterance by the per-utterance
# greedy search (icefall's ``max_sym_per_utt``).
MAX_SYM_PER_UTT = 1000


@torch.inference_mode()
def greedy_search_batch(model: nn.Module, encoder_out: Tensor, encoder_out_lens: Tensor) -> List[List[int]]:
    """Batched greedy search with one symbol per frame.

    At every frame the joiner's argmax is taken; a token other than blank/unk
    is appended and the decoder context of that utterance advances.

    Args:
      model: transducer with ``.decoder`` and ``.joiner``.
      encoder_out: (N, T, encoder_dim).
      encoder_out_lens: (N,) valid frames per utterance, each in [1, T].
    Returns:
      N token-id lists (blank and unk removed), in input order.
    """
    lens = check_inputs(encoder_out, encoder_out_lens)
    with eval_mode(model):
        return _greedy_batch(model, encoder_out, lens)


def _greedy_batch(model: nn.Module, encoder_out: Tensor, lens: List[int]) -> List[List[int]]:
    """Body of :func:`greedy_search_batch` (model already in eval mode)."""
    return search_sorted(
        model,
        encoder_out,
        lens,
        lambda n: GreedyBatchSearch(
            *model_functions(model), model_initial_context(model), n, model_skip_ids(model), encoder_out.device
        ),
    )


class GreedyBatchSearch(FrameSearch):
    """Greedy search with one symbol per frame over ``num_streams`` streams, one frame per :meth:`step`.

    At every frame the joiner's argmax is taken; a token other than blank/unk
    is appended and the decoder context of that stream advances. The work
    stays on the device (no host synchronisation per frame).

    Args (``decoder_fn``, ``joiner_fn``, ``skip_ids``: see :class:`~icefall_lite.decoding.search_utils.FrameSearch`):
      initial_context: the first decoder context of every stream (``context_size`` ids).
      num_streams: N.
      device: where the contexts live (that of the encoder frames).
    """

    def __init__(
        self,
        decoder_fn: DecoderFn,
        joiner_fn: JoinerFn,
        initial_context: Sequence[int],
        num_streams: int,
        skip_ids: Sequence[int],
        device: torch.device,
    ) -> None:
        super().__init__(decoder_fn, joiner_fn, skip_ids)
        self.context = torch.tensor([list(initial_context)] * num_streams, device=device)  # (N, c)
        self.dec = decoder_fn(self.context)  # (N, J)
        self.emitted: List[Tensor] = []  # per step: (b,) token or -1

    def step(self, enc_t: Tensor) -> None:
        """Advance streams ``0 .. b-1`` by one frame.

        Args:
          enc_t: (b, J) projected encoder frame of each of the first b streams, b <= N.
        """
        b = enc_t.size(0)
        logits = self.joiner_fn(enc_t, self.dec[:b])  # (b, V)
        y = logits.argmax(dim=-1).to(self.context.device)  # (b,)
        emit = torch.ones_like(y, dtype=torch.bool)
        for skip in self.skip_ids:
            emit &= y != skip
        self.emitted.append(torch.where(emit, y, torch.full_like(y, -1)))
        shifted = torch.cat([self.context[:b, 1:], y.unsqueeze(1)], dim=1)
        self.context[:b] = torch.where(emit.unsqueeze(1), shifted, self.context[:b])
        # Contexts that did not change give the same decoder output again.
        self.dec[:b] = self.decoder_fn(self.context[:b]).to(self.dec.device)

    def results(self) -> List[List[int]]:
        """Token ids emitted so far by each stream (blank and unk removed)."""
        n = self.context.size(0)
        padded = torch.full((n, len(self.emitted)), -1, dtype=torch.int64)
        if self.emitted:
            sizes = [tokens.size(0) for tokens in self.emitted]
            for t, tokens in enumerate(torch.cat(self.emitted).cpu().split(sizes)):  # one device-to-host copy
                padded[: sizes[t], t] = tokens
        return [row[row >= 0].tolist() for row in padded]


@torch.inference_mode()
def greedy_search(model: nn.Module, encoder_out: Tensor, max_sym_per_frame: int = 1) -> List[int]:
    """Greedy search for one utterance, up to ``max_sym_per_frame`` symbols per frame.

    On each frame the joiner's argmax is taken repeatedly: a token other than
    blank/unk is appended (the decoder context advances) and the same frame is
    scored again, until blank/unk wins or ``max_sym_per_frame`` symbols were
    emitted on the frame; then the search moves to the next frame. At most
    ``MAX_SYM_PER_UTT`` (1000) symbols per utterance, as icefall.

    Args:
      model: transducer with ``.decoder`` and ``.joiner``.
      encoder_out: (1, T, encoder_dim).
      max_sym_per_frame: >= 1.
    Returns:
      token ids (blank and unk removed).
    """
    if encoder_out.ndim != 3 or encoder_out.size(0) != 1:
        raise ValueError(f"greedy_search takes encoder_out of shape (1, T, C), got {tuple(encoder_out.shape)}")
    if max_sym_per_frame < 1:
        raise ValueError(f"max_sym_per_frame must be >= 1, got {max_sym_per_frame}")
    with eval_mode(model):
        return _greedy_one(model, encoder_out, max_sym_per_frame)


def _greedy_one(model: nn.Module, encoder_out: Tensor, max_sym_per_frame: int) -> List[int]:
    """Body of :func:`greedy_search` (model already in eval mode)."""
    device = encoder_out.device
    blank_id, unk_id = model_skip_ids(model)
    enc = model.joiner.encoder_proj(encoder_out[0])  # (T, J)
    context = model_initial_context(model)
    dec = model_decoder_out(model, torch.tensor([context], device=device))  # (1, J)

    hyp: List[int] = []
    t, sym_this_frame = 0, 0
    while t < enc.size(0) and len(hyp) < MAX_SYM_PER_UTT:
        if sym_this_frame >= max_sym_per_frame:
            t, sym_this_frame = t + 1, 0
            continue
        y = int(model.joiner(enc[t : t + 1], dec, project_input=False).argmax())
        if y in (blank_id, unk_id):
            t, sym_this_frame = t + 1, 0
            continue
        hyp.append(y)
        sym_this_frame += 1
        context = context[1:] + [y]
        dec = model_decoder_out(model, torch.tensor([context], device=device))
    return hyp


__all__ = ["MAX_SYM_PER_UTT", "greedy_search", "greedy_search_batch", "GreedyBatchSearch"]
