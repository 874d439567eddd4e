"""Streaming decoding of the LSTM transducer: chunk by chunk, LSTM states carried, as sherpa-onnx runs it.

The model is anything with the streaming interface :class:`StreamingModel`:
``meta``, ``init_states``, ``run_encoder``, ``run_decoder`` and ``run_joiner``.
:class:`TorchStreamingModel` runs a PyTorch :class:`~icefall_lite.nn.model.Transducer`
through its streaming API (``get_init_states``, ``streaming_forward``,
``predict``, ``join``); :class:`~icefall_lite.export.onnx_export.ExportableTransducer`
is the same over the converted (exportable) model, and
:class:`~icefall_lite.export.onnx_runtime.OnnxRuntimeTransducer` runs the exported
files with onnxruntime. Nothing here imports ONNX or the export package.

:func:`streaming_search` feeds the encoder windows of ``T = decode_chunk_len + 5``
feature frames every ``decode_chunk_len`` frames (9 and 4 by default), exactly
the windows sherpa-onnx's ``OnlineRecognizer`` feeds (:func:`chunk_starts`),
with all utterances of a batch decoded side by side, each with its own states.
After every chunk, greedy search or icefall's modified beam search
(:class:`~icefall_lite.decoding.greedy_search.GreedyBatchSearch`,
:class:`~icefall_lite.decoding.modified_beam_search.ModifiedBeamSearch`) advances by the chunk's
encoder frames. As in sherpa-onnx, the initial decoder context is
``[-1] * (context_size - 1) + [blank_id]`` (the offline searches' and
sherpa-onnx's since 2023; icefall's ``streaming_decode.py`` starts from
``context_size`` blanks, which differs now that the blank row is learned) and
at most one symbol is emitted per frame; ``unk_id`` is treated like blank, as
sherpa-onnx does.

Tail padding (frames appended after the speech so the last words come out) is
the caller's business, as it is sherpa-onnx's user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.decoding.constants import DEFAULT_DECODE_CHUNK_LEN, STREAMING_METHODS
from icefall_lite.decoding.greedy_search import GreedyBatchSearch
from icefall_lite.decoding.modified_beam_search import ModifiedBeamSearch
from icefall_lite.decoding.search_utils import sort_by_length, unsort
from icefall_lite.nn.encoder import SUBSAMPLING_EXTRA_FRAMES, SUBSAMPLING_FACTOR, EncoderStates
from icefall_lite.nn.model import Transducer

MODEL_AUTHOR = "icefall-lite"


@dataclass(frozen=True)
class StreamingMeta:
    """Sizes of a streaming model and its chunking (what sherpa-onnx reads from the ONNX metadata)."""

    num_encoder_layers: int
    d_model: int
    rnn_hidden_size: int
    decode_chunk_len: int
    T: int
    vocab_size: int
    context_size: int
    joiner_dim: int

    @classmethod
    def of_model(cls, model: Transducer, decode_chunk_len: int = DEFAULT_DECODE_CHUNK_LEN) -> "StreamingMeta":
        """The sizes of ``model`` with windows of ``T = decode_chunk_len + 5`` frames.

        Args:
          decode_chunk_len: feature frames between chunks; a positive multiple of 4.
        """
        if decode_chunk_len <= 0 or decode_chunk_len % SUBSAMPLING_FACTOR != 0:
            raise ValueError(
                f"decode_chunk_len must be a positive multiple of {SUBSAMPLING_FACTOR}, got {decode_chunk_len}"
            )
        return cls(
            num_encoder_layers=model.encoder.num_layers,
            d_model=model.encoder.d_model,
            rnn_hidden_size=model.encoder.rnn_hidden_size,
            decode_chunk_len=decode_chunk_len,
            T=decode_chunk_len + SUBSAMPLING_EXTRA_FRAMES,
            vocab_size=model.decoder.vocab_size,
            context_size=model.decoder.context_size,
            joiner_dim=model.joiner.output_linear.in_features,
        )

    def encoder_metadata(self) -> Dict[str, str]:
        """Key/values of the encoder model (``model_type=lstm`` is what selects the LSTM code in sherpa-onnx)."""
        return {
            "model_type": "lstm",
            "version": "1",
            "model_author": MODEL_AUTHOR,
            "decode_chunk_len": str(self.decode_chunk_len),
            "T": str(self.T),
            "num_encoder_layers": str(self.num_encoder_layers),
            "d_model": str(self.d_model),
            "rnn_hidden_size": str(self.rnn_hidden_size),
        }

    def decoder_metadata(self) -> Dict[str, str]:
        return {"vocab_size": str(self.vocab_size), "context_size": str(self.context_size)}

    def joiner_metadata(self) -> Dict[str, str]:
        return {"joiner_dim": str(self.joiner_dim)}

    @classmethod
    def from_metadata(cls, encoder: Dict[str, str], decoder: Dict[str, str], joiner: Dict[str, str]) -> "StreamingMeta":
        """Inverse of the three ``*_metadata`` methods."""
        merged = {**encoder, **decoder, **joiner}
        return cls(**{name: int(merged[name]) for name in cls.__dataclass_fields__})


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


class TorchStreamingModel(nn.Module):
    """A :class:`~icefall_lite.nn.model.Transducer` (in eval mode) with the :class:`StreamingModel` interface.

    Args:
      model: the transducer; its streaming API does the work.
      decode_chunk_len: feature frames between chunks (a positive multiple of 4).
    """

    def __init__(self, model: Transducer, decode_chunk_len: int = DEFAULT_DECODE_CHUNK_LEN) -> None:
        super().__init__()
        self.meta = StreamingMeta.of_model(model, decode_chunk_len)
        self.model = model.eval()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def init_states(self, batch_size: int = 1) -> EncoderStates:
        """Zeros: h (L, N, d_model), c (L, N, rnn_hidden_size), on the model's device."""
        return self.model.get_init_states(batch_size)

    @torch.no_grad()
    def run_encoder(self, x: Tensor, states: EncoderStates) -> Tuple[Tensor, EncoderStates]:
        """x (N, T, F) -> encoder_out (N, T', joiner_dim), next states."""
        return self.model.streaming_forward(x.to(self.device), states)

    @torch.no_grad()
    def run_decoder(self, y: Tensor) -> Tensor:
        """y (N, context_size) -> (N, joiner_dim)."""
        return self.model.predict(y.to(self.device, torch.int64))

    @torch.no_grad()
    def run_joiner(self, encoder_out: Tensor, decoder_out: Tensor) -> Tensor:
        """(N, joiner_dim), (N, joiner_dim) -> logit (N, vocab_size)."""
        return self.model.join(encoder_out, decoder_out)


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


def make_frame_search(
    model: StreamingModel,
    decoding_method: str,
    num_streams: int,
    skip_ids: Tuple[int, ...],
    blank_id: int,
    beam_size: int,
    device: torch.device,
) -> Union[GreedyBatchSearch, ModifiedBeamSearch]:
    """The frame-by-frame search of ``decoding_method`` over the model's decoder and joiner, for ``num_streams``
    streams (streaming decoding here and the chunked decoding of long files: :mod:`icefall_lite.decoding.chunked`)."""
    # sherpa-onnx's first context (GetEmptyResult); -1 embeds to zero, blank's row is learned.
    initial_context = [-1] * (model.meta.context_size - 1) + [blank_id]
    if decoding_method == "greedy_search":
        return GreedyBatchSearch(model.run_decoder, model.run_joiner, initial_context, num_streams, skip_ids, device)
    if decoding_method == "modified_beam_search":
        return ModifiedBeamSearch(
            model.run_decoder, model.run_joiner, initial_context, num_streams, skip_ids, beam_size
        )
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
    order, _, batch_sizes = sort_by_length([len(s) for s in starts])
    h, c = model.init_states(batch_size=n)
    skip_ids = (blank_id,) if unk_id is None else (blank_id, unk_id)
    search = make_frame_search(model, decoding_method, n, skip_ids, blank_id, beam_size, h.device)
    for k, b in enumerate(batch_sizes):
        active = order[:b]  # the utterances with more than k chunks
        x = torch.stack([features[i][starts[i][k] : starts[i][k] + meta.T] for i in active]).to(h.device)
        encoder_out, (next_h, next_c) = model.run_encoder(x, (h[:, :b], c[:, :b]))
        h[:, :b], c[:, :b] = next_h.to(h.device), next_c.to(c.device)
        for t in range(encoder_out.size(1)):
            search.step(encoder_out[:, t])
    return unsort(search.results(), order)


__all__ = [
    "StreamingMeta",
    "StreamingModel",
    "TorchStreamingModel",
    "chunk_starts",
    "make_frame_search",
    "streaming_search",
]
