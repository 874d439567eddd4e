"""Streaming decoding of the LSTM transducer: chunk by chunk, LSTM states carried, as sherpa-onnx runs it.

The model is anything with the streaming interface of
:class:`~icefall_lite.export.onnx_export.ExportableTransducer` (the PyTorch modules
that get exported) or :class:`~icefall_lite.export.onnx_export.OnnxRuntimeTransducer`
(the exported files run with onnxruntime): ``meta``, ``init_states``,
``run_encoder``, ``run_decoder`` and ``run_joiner`` (:class:`StreamingModel`).

:func:`streaming_search` feeds the encoder windows of ``T = decode_chunk_len + 5``
feature frames every ``decode_chunk_len`` frames (9 and 4 by default), exactly
the windows sherpa-onnx's ``OnlineRecognizer`` feeds (:func:`chunk_starts`),
with all utterances of a batch decoded side by side, each with its own states.
After every chunk, greedy search or icefall's modified beam search
(:class:`~icefall_lite.decoding.search.GreedyBatchSearch`,
:class:`~icefall_lite.decoding.search.ModifiedBeamSearch`) advances by the chunk's
encoder frames. As in sherpa-onnx and icefall's ``streaming_decode.py``, the
initial decoder context is ``context_size`` blanks and at most one symbol is
emitted per frame; ``unk_id`` is treated like blank, as sherpa-onnx does.

Tail padding (frames appended after the speech so the last words come out) is
the caller's business, as it is sherpa-onnx's user's.
"""

from __future__ import annotations

from typing import List, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch import Tensor

from icefall_lite.export.onnx_export import StreamingMeta
from icefall_lite.decoding.search import GreedyBatchSearch, ModifiedBeamSearch

EncoderStates = Tuple[Tensor, Tensor]
STREAMING_METHODS = ("greedy_search", "modified_beam_search")


class StreamingModel(Protocol):
    """What :func:`streaming_search` needs of a model (see the module doc)."""

    meta: StreamingMeta

    def init_states(self, batch_size: int = 1) -> EncoderStates:
        """Zeros: h (L, N, d_model), c (L, N, rnn_hidden_size)."""

    def run_encoder(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """x (N, T, F) -> encoder_out (N, T', joiner_dim), next states."""

    def run_decoder(self, y: Tensor) -> Tensor:
        """y (N, context_size) -> (N, joiner_dim)."""

    def run_joiner(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        """(N, joiner_dim), (N, joiner_dim) -> logit (N, vocab_size)."""


def chunk_starts(num_frames: int, chunk_size: int, chunk_shift: int) -> range:
    """Start frames of the windows sherpa-onnx feeds the encoder.

    sherpa-onnx (``OnlineRecognizerTransducerImpl::IsReady``) runs a chunk
    while ``start + chunk_size < num_frames_ready`` and then advances
    ``start`` by ``chunk_shift``: a window that ends exactly on the last frame
    is not run. Tail padding (extra silence) is the caller's business.
    """
    if num_frames <= chunk_size:
        return range(0)
    return range(0, num_frames - chunk_size, chunk_shift)


def _make_search(
    model: StreamingModel,
    decoding_method: str,
    num_streams: int,
    skip_ids: Tuple[int, ...],
    blank_id: int,
    beam_size: int,
    device: torch.device,
) -> Union[GreedyBatchSearch, ModifiedBeamSearch]:
    """The frame-by-frame search of ``decoding_method`` over the model's decoder and joiner."""
    initial_context = [blank_id] * model.meta.context_size
    if decoding_method == "greedy_search":
        return GreedyBatchSearch(model.run_decoder, model.run_joiner, initial_context, num_streams, skip_ids, device)
    if decoding_method == "modified_beam_search":
        return ModifiedBeamSearch(model.run_decoder, model.run_joiner, initial_context, num_streams, skip_ids, beam_size)
    raise ValueError(f"Unsupported streaming decoding method {decoding_method!r}; use one of {STREAMING_METHODS}")


@torch.inference_mode()
def streaming_search(
    model: StreamingModel,
    features: Sequence[Tensor],
    decoding_method: str = "greedy_search",
    beam_size: int = 4,
    blank_id: int = 0,
    unk_id: Optional[int] = None,
) -> List[List[int]]:
    """Decode utterances chunk by chunk, carrying each one's LSTM states, all in one batch.

    Utterances are sorted by their number of chunks, so the ones still running
    at chunk ``k`` are a prefix of the batch; each encoder call gets the next
    window of every running utterance and their states.

    Args:
      model: the PyTorch wrappers or the onnxruntime sessions (:class:`StreamingModel`).
      features: N tensors (num_frames_i, F), fbank of each utterance (tail padding included).
      decoding_method: ``greedy_search`` or ``modified_beam_search``.
      beam_size: hypotheses kept per utterance by modified beam search.
      blank_id: the blank id (sherpa-onnx: always 0).
      unk_id: treated as blank when given.
    Returns:
      N token-id lists (blank and unk removed), in input order.
    """
    if decoding_method not in STREAMING_METHODS:
        raise ValueError(f"Unsupported streaming decoding method {decoding_method!r}; use one of {STREAMING_METHODS}")
    n = len(features)
    if n == 0:
        return []
    meta = model.meta
    starts = [chunk_starts(f.size(0), meta.T, meta.decode_chunk_len) for f in features]
    order = sorted(range(n), key=lambda i: -len(starts[i]))
    h, c = model.init_states(batch_size=n)
    skip_ids = (blank_id,) if unk_id is None else (blank_id, unk_id)
    search = _make_search(model, decoding_method, n, skip_ids, blank_id, beam_size, h.device)
    for k in range(len(starts[order[0]])):
        active = [i for i in order if len(starts[i]) > k]  # a prefix of ``order``
        b = len(active)
        x = torch.stack([features[i][starts[i][k] : starts[i][k] + meta.T] for i in active]).to(h.device)
        encoder_out, (next_h, next_c) = model.run_encoder(x, (h[:, :b], c[:, :b]))
        h[:, :b], c[:, :b] = next_h.to(h.device), next_c.to(c.device)
        for t in range(encoder_out.size(1)):
            search.step(encoder_out[:, t])
    hyps = search.results()
    result: List[List[int]] = [[] for _ in range(n)]
    for j, i in enumerate(order):
        result[i] = hyps[j]
    return result


__all__ = ["STREAMING_METHODS", "StreamingModel", "chunk_starts", "streaming_search"]
