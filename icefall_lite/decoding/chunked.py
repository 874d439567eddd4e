"""Decoding a recording of any length in bounded memory: its feature frames, as they are computed, go through the
encoder in windows with the LSTM states carried, and the search advances after every window.

The windows are :mod:`icefall_lite.decoding.streaming`'s: ``T = chunk + 5`` frames every ``chunk`` frames (a
multiple of 4), which give the encoder output frames ``chunk / 4`` at a time exactly as the whole utterance gives
them (:mod:`icefall_lite.export.onnx_export` explains why). :func:`encoder_windows` cuts them from a stream of
frame blocks, keeping only the frames no window has used up; two end rules:

- ``sherpa=True``: a window runs while ``start + T < frames seen`` and no partial window follows the last
  (sherpa-onnx's rule, :func:`~icefall_lite.decoding.streaming.chunk_starts`): what the ONNX files run;
- ``sherpa=False``: full windows run as soon as their frames are there and a last, shorter window takes the
  frames left (if it makes an output frame), so that the output frames are exactly those of the encoder on the
  whole utterance (``((T - 3) // 2 - 1) // 2``): what pretrained.py's PyTorch model runs.
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Union

import torch
from torch import Tensor

from icefall_lite.decoding.greedy_search import GreedyBatchSearch
from icefall_lite.decoding.modified_beam_search import ModifiedBeamSearch
from icefall_lite.decoding.streaming import StreamingModel
from icefall_lite.nn.encoder import SUBSAMPLING_EXTRA_FRAMES, SUBSAMPLING_FACTOR, EncoderStates

# Frames a window needs to make one output frame.
MIN_WINDOW_FRAMES = SUBSAMPLING_FACTOR + SUBSAMPLING_EXTRA_FRAMES


def encoder_windows(blocks: Iterable[Tensor], chunk: int, sherpa: bool) -> Iterator[Tensor]:
    """The encoder windows (T, F), ``T = chunk + 5`` frames every ``chunk`` frames, over frame blocks (n_i, F).

    Args:
      blocks: the utterance's feature frames, block after block (any sizes, tail padding included).
      chunk: frames between two windows, a positive multiple of 4.
      sherpa: the end rule (see the module doc).
    """
    if chunk <= 0 or chunk % SUBSAMPLING_FACTOR:
        raise ValueError(f"chunk must be a positive multiple of {SUBSAMPLING_FACTOR}, got {chunk}")
    size = chunk + SUBSAMPLING_EXTRA_FRAMES
    need = size + 1 if sherpa else size  # frames from a window's start on that let it run
    pending: List[Tensor] = []  # frames from the next window's start on
    num_pending = 0
    for block in blocks:
        pending.append(block)
        num_pending += block.size(0)
        if num_pending < need:
            continue
        frames = torch.cat(pending)
        start = 0
        while frames.size(0) - start >= need:
            yield frames[start : start + size]
            start += chunk
        pending, num_pending = [frames[start:]], frames.size(0) - start
    if not sherpa and num_pending >= MIN_WINDOW_FRAMES:
        yield torch.cat(pending)


def chunked_search(
    model: StreamingModel,
    blocks: Iterable[Tensor],
    search: Union[GreedyBatchSearch, ModifiedBeamSearch],
    sherpa: bool,
) -> List[int]:
    """Decode one utterance from its frame blocks: ``model``'s windows (``model.meta.decode_chunk_len``) through
    ``model.run_encoder`` with the states carried, ``search`` (for one stream) stepped over every output frame.

    Returns:
      the token ids of ``search.results()[0]``.
    """
    states: EncoderStates = model.init_states(batch_size=1)
    for window in encoder_windows(blocks, model.meta.decode_chunk_len, sherpa):
        encoder_out, states = model.run_encoder(window.unsqueeze(0), states)
        for t in range(encoder_out.size(1)):
            search.step(encoder_out[:, t])
    return search.results()[0]


__all__ = ["MIN_WINDOW_FRAMES", "encoder_windows", "chunked_search"]
