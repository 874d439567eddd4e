"""What the transducer searches share: model adapters, input checks and the sort-by-length batching.

The conventions of every search (greedy: :mod:`icefall_lite.decoding.greedy_search`;
modified beam: :mod:`icefall_lite.decoding.modified_beam_search`; fast beam:
:mod:`icefall_lite.decoding.fast_beam_search`).

All searches take encoder output directly, as icefall's ``beam_search.py`` does,
and a model with ``.decoder`` (a stateless :class:`~icefall_lite.nn.decoder.Decoder`
with ``blank_id``, ``context_size`` and ``vocab_size``) and ``.joiner`` (a
:class:`~icefall_lite.nn.joiner.Joiner`). Encoder frames are projected once with
``joiner.encoder_proj`` and decoder outputs with ``joiner.decoder_proj``; the
joiner is then called with ``project_input=False``.

Common conventions:

- the initial decoder context is ``[-1] * (context_size - 1) + [blank_id]``;
- every search runs under :func:`torch.inference_mode` with the model in eval
  mode (its previous mode is restored afterwards), on the device of
  ``encoder_out``;
- utterances in a batch may have different lengths (``encoder_out_lens``);
  they are sorted by length so that the utterances still active at frame ``t``
  are a prefix of the batch (what icefall gets from ``pack_padded_sequence``),
  and results come back in the input order;
- returned hypotheses are lists of token ids without blank. Greedy and
  modified beam search also drop ``model.unk_id`` when the model has that
  attribute (icefall: ``unk_id = getattr(model, "unk_id", blank_id)``); an
  unk symbol is treated like blank (no context change). Fast beam search
  treats unk as an ordinary token, as k2's trivial graph does.

Greedy and modified beam search are also available frame by frame, for
streaming: ``GreedyBatchSearch`` and ``ModifiedBeamSearch`` keep the
hypotheses of ``N`` streams and advance the first ``b`` of them by one encoder
frame per :meth:`step` call. They take the decoder and joiner as functions
(:data:`DecoderFn`, :data:`JoinerFn`), so the same search runs a PyTorch
transducer or its exported ONNX files (:mod:`icefall_lite.decoding.streaming`).
"""

from __future__ import annotations

import abc
import contextlib
import functools
from typing import Callable, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

# contexts (M, context_size) int64 -> projected decoder output (M, joiner_dim)
DecoderFn = Callable[[Tensor], Tensor]
# projected encoder frames (M, joiner_dim), projected decoder outputs (M, joiner_dim) -> logits (M, vocab_size)
JoinerFn = Callable[[Tensor, Tensor], Tensor]

# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode for the duration, then restore its mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def model_skip_ids(model: nn.Module) -> Tuple[int, int]:
    """(blank_id, unk_id) where unk defaults to blank, as in icefall."""
    blank_id = int(model.decoder.blank_id)
    return blank_id, int(getattr(model, "unk_id", blank_id))


def model_initial_context(model: nn.Module) -> List[int]:
    """icefall's initial decoder context ``[-1]*(context_size-1) + [blank]``."""
    return [-1] * (model.decoder.context_size - 1) + [model.decoder.blank_id]


def model_decoder_out(model: nn.Module, contexts: Tensor) -> Tensor:
    """Projected decoder output.

    Args:
      contexts: (M, context_size) int64 token ids.
    Returns:
      (M, joiner_dim).
    """
    out = model.decoder(contexts, need_pad=False)  # (M, 1, decoder_dim)
    return model.joiner.decoder_proj(out.squeeze(1))


def model_functions(model: nn.Module) -> Tuple[DecoderFn, JoinerFn]:
    """The :data:`DecoderFn` and :data:`JoinerFn` of a transducer with ``.decoder`` and ``.joiner``."""
    return functools.partial(model_decoder_out, model), functools.partial(model.joiner, project_input=False)


def joiner_log_probs(model: nn.Module, enc: Tensor, dec: Tensor) -> Tensor:
    """log_softmax of the joiner on projected inputs.

    Args:
      enc: (..., joiner_dim) projected encoder frames.
      dec: (..., joiner_dim) projected decoder outputs, broadcastable with enc.
    Returns:
      (..., vocab_size) float32 log-probabilities.
    """
    logits = model.joiner(enc, dec, project_input=False)
    return logits.float().log_softmax(dim=-1)


def check_inputs(encoder_out: Tensor, encoder_out_lens: Tensor) -> List[int]:
    """Validate batch inputs and return the lengths as a Python list."""
    if encoder_out.ndim != 3:
        raise ValueError(f"encoder_out must be (N, T, C), got shape {tuple(encoder_out.shape)}")
    lens = [int(x) for x in encoder_out_lens.tolist()]
    if len(lens) != encoder_out.size(0):
        raise ValueError(f"encoder_out_lens has {len(lens)} entries for a batch of {encoder_out.size(0)}")
    if any(n <= 0 or n > encoder_out.size(1) for n in lens):
        raise ValueError(f"encoder_out_lens must be in [1, {encoder_out.size(1)}], got {lens}")
    return lens


def sort_by_length(lens: Sequence[int]) -> Tuple[List[int], List[int], List[int]]:
    """Sort utterances by decreasing length (stable).

    Returns:
      order: ``order[j]`` is the input index of sorted position ``j``.
      sorted_lens: lengths in sorted order.
      batch_sizes: ``batch_sizes[t]`` = number of utterances with more than
        ``t`` frames (the active prefix at frame ``t``), for t < max length.
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    sorted_lens = [lens[i] for i in order]
    batch_sizes = []
    active = len(sorted_lens)
    for t in range(sorted_lens[0]):
        while sorted_lens[active - 1] <= t:
            active -= 1
        batch_sizes.append(active)
    return order, sorted_lens, batch_sizes


def unsort(values: Sequence, order: Sequence[int]) -> list:
    """Inverse of sorting by ``order``: the result is in input order."""
    out: list = [None] * len(order)
    for j, i in enumerate(order):
        out[i] = values[j]
    return out


def project_sorted(model: nn.Module, encoder_out: Tensor, order: Sequence[int], max_len: int) -> Tensor:
    """Sorted, truncated and projected encoder output: (N, max_len, joiner_dim)."""
    index = torch.as_tensor(list(order), device=encoder_out.device)
    return model.joiner.encoder_proj(encoder_out[index, :max_len])


class FrameSearch(abc.ABC):
    """A frame-by-frame search over N streams (:class:`~icefall_lite.decoding.greedy_search.GreedyBatchSearch`,
    :class:`~icefall_lite.decoding.modified_beam_search.ModifiedBeamSearch`).

    Args:
      decoder_fn: contexts (M, context_size) -> projected decoder output (M, J).
      joiner_fn: (M, J), (M, J) -> logits (M, V).
      skip_ids: ids that are not emitted and keep the context (blank, unk).
    """

    def __init__(self, decoder_fn: DecoderFn, joiner_fn: JoinerFn, skip_ids: Sequence[int]) -> None:
        self.decoder_fn = decoder_fn
        self.joiner_fn = joiner_fn
        self.skip_ids = tuple(skip_ids)

    @abc.abstractmethod
    def step(self, enc_t: Tensor) -> None:
        """Advance the first b streams by one projected encoder frame enc_t (b, joiner_dim)."""

    @abc.abstractmethod
    def results(self) -> List[List[int]]:
        """Token ids of every stream."""


def search_sorted(
    model: nn.Module, encoder_out: Tensor, lens: List[int], make_search: Callable[[int], FrameSearch]
) -> List[List[int]]:
    """Sort by length, run ``make_search(N)`` frame by frame over the active prefix, unsort.

    Args:
      encoder_out: (N, T, encoder_dim), projected here with ``joiner.encoder_proj``.
      lens: valid frames per utterance.
    Returns:
      N token-id lists, in input order.
    """
    order, sorted_lens, batch_sizes = sort_by_length(lens)
    enc = project_sorted(model, encoder_out, order, sorted_lens[0])  # (N, T, J)
    search = make_search(enc.size(0))
    for t, b in enumerate(batch_sizes):
        search.step(enc[:b, t])
    return unsort(search.results(), order)


__all__ = [
    "DecoderFn",
    "JoinerFn",
    "FrameSearch",
    "eval_mode",
    "model_skip_ids",
    "model_initial_context",
    "model_decoder_out",
    "model_functions",
    "joiner_log_probs",
    "check_inputs",
    "sort_by_length",
    "unsort",
    "project_sorted",
    "search_sorted",
]
