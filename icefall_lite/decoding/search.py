"""Transducer decoding: greedy search, modified beam search and fast beam search.

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
streaming: :class:`GreedyBatchSearch` and :class:`ModifiedBeamSearch` keep the
hypotheses of ``N`` streams and advance the first ``b`` of them by one encoder
frame per :meth:`step` call. They take the decoder and joiner as functions
(:data:`DecoderFn`, :data:`JoinerFn`), so the same search runs a PyTorch
transducer or its exported ONNX files (:mod:`icefall_lite.decoding.streaming`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

# Maximum number of symbols emitted in one utterance by the per-utterance
# greedy search (icefall's ``max_sym_per_utt``).
MAX_SYM_PER_UTT = 1000

# contexts (M, context_size) int64 -> projected decoder output (M, joiner_dim)
DecoderFn = Callable[[Tensor], Tensor]
# projected encoder frames (M, joiner_dim), projected decoder outputs (M, joiner_dim) -> logits (M, vocab_size)
JoinerFn = Callable[[Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode for the duration, then restore its mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _skip_ids(model: nn.Module) -> Tuple[int, int]:
    """(blank_id, unk_id) where unk defaults to blank, as in icefall."""
    blank_id = int(model.decoder.blank_id)
    return blank_id, int(getattr(model, "unk_id", blank_id))


def _initial_context(model: nn.Module) -> List[int]:
    """icefall's initial decoder context ``[-1]*(context_size-1) + [blank]``."""
    return [-1] * (model.decoder.context_size - 1) + [model.decoder.blank_id]


def _decoder_out(model: nn.Module, contexts: Tensor) -> Tensor:
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
    return functools.partial(_decoder_out, model), functools.partial(model.joiner, project_input=False)


def _log_probs(model: nn.Module, enc: Tensor, dec: Tensor) -> Tensor:
    """log_softmax of the joiner on projected inputs.

    Args:
      enc: (..., joiner_dim) projected encoder frames.
      dec: (..., joiner_dim) projected decoder outputs, broadcastable with enc.
    Returns:
      (..., vocab_size) float32 log-probabilities.
    """
    logits = model.joiner(enc, dec, project_input=False)
    return logits.float().log_softmax(dim=-1)


def _check_inputs(encoder_out: Tensor, encoder_out_lens: Tensor) -> List[int]:
    """Validate batch inputs and return the lengths as a Python list."""
    if encoder_out.ndim != 3:
        raise ValueError(f"encoder_out must be (N, T, C), got shape {tuple(encoder_out.shape)}")
    lens = [int(x) for x in encoder_out_lens.tolist()]
    if len(lens) != encoder_out.size(0):
        raise ValueError(f"encoder_out_lens has {len(lens)} entries for a batch of {encoder_out.size(0)}")
    if any(n <= 0 or n > encoder_out.size(1) for n in lens):
        raise ValueError(f"encoder_out_lens must be in [1, {encoder_out.size(1)}], got {lens}")
    return lens


def _sort_by_length(lens: Sequence[int]) -> Tuple[List[int], List[int], List[int]]:
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


def _unsort(values: Sequence, order: Sequence[int]) -> list:
    """Inverse of sorting by ``order``: the result is in input order."""
    out: list = [None] * len(order)
    for j, i in enumerate(order):
        out[i] = values[j]
    return out


def _project_sorted(model: nn.Module, encoder_out: Tensor, order: Sequence[int], max_len: int) -> Tensor:
    """Sorted, truncated and projected encoder output: (N, max_len, joiner_dim)."""
    index = torch.as_tensor(list(order), device=encoder_out.device)
    return model.joiner.encoder_proj(encoder_out[index, :max_len])


# --------------------------------------------------------------------------
# Greedy search
# --------------------------------------------------------------------------


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
    lens = _check_inputs(encoder_out, encoder_out_lens)
    with _eval_mode(model):
        return _greedy_batch(model, encoder_out, lens)


def _greedy_batch(model: nn.Module, encoder_out: Tensor, lens: List[int]) -> List[List[int]]:
    """Body of :func:`greedy_search_batch` (model already in eval mode)."""
    order, sorted_lens, batch_sizes = _sort_by_length(lens)
    enc = _project_sorted(model, encoder_out, order, sorted_lens[0])  # (N, T, J)
    search = GreedyBatchSearch(
        *model_functions(model), _initial_context(model), enc.size(0), _skip_ids(model), encoder_out.device
    )
    for t, b in enumerate(batch_sizes):
        search.step(enc[:b, t])
    return _unsort(search.results(), order)


class GreedyBatchSearch:
    """Greedy search with one symbol per frame over ``num_streams`` streams, one frame per :meth:`step`.

    At every frame the joiner's argmax is taken; a token other than blank/unk
    is appended and the decoder context of that stream advances. The work
    stays on the device (no host synchronisation per frame).

    Args:
      decoder_fn: contexts (M, context_size) -> projected decoder output (M, J).
      joiner_fn: (M, J), (M, J) -> logits (M, V).
      initial_context: the first decoder context of every stream (``context_size`` ids).
      num_streams: N.
      skip_ids: ids that are not emitted and keep the context (blank, unk).
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
        self.decoder_fn = decoder_fn
        self.joiner_fn = joiner_fn
        self.skip_ids = tuple(skip_ids)
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
    with _eval_mode(model):
        return _greedy_one(model, encoder_out, max_sym_per_frame)


def _greedy_one(model: nn.Module, encoder_out: Tensor, max_sym_per_frame: int) -> List[int]:
    """Body of :func:`greedy_search` (model already in eval mode)."""
    device = encoder_out.device
    blank_id, unk_id = _skip_ids(model)
    enc = model.joiner.encoder_proj(encoder_out[0])  # (T, J)
    context = _initial_context(model)
    dec = _decoder_out(model, torch.tensor([context], device=device))  # (1, J)

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
        dec = _decoder_out(model, torch.tensor([context], device=device))
    return hyp


# --------------------------------------------------------------------------
# Modified beam search
# --------------------------------------------------------------------------


class _PrefixTree:
    """Interns token sequences: one integer id per distinct sequence.

    Two hypotheses with the same tokens get the same id, so merging by
    sequence (icefall's ``HypothesisList`` keyed by ``"_".join(ys)``) is a
    dict lookup on an int, and extending a hypothesis costs O(context_size)
    instead of copying its whole token list.
    """

    def __init__(self, initial_context: Sequence[int]) -> None:
        self._children: Dict[Tuple[int, int], int] = {}
        self.parent: List[int] = [-1]
        self.token: List[int] = [-1]
        self.depth: List[int] = [0]
        self.context: List[Tuple[int, ...]] = [tuple(initial_context)]

    def child(self, node: int, token: int) -> int:
        """Id of the sequence ``node`` followed by ``token``."""
        key = (node, token)
        found = self._children.get(key)
        if found is not None:
            return found
        new = len(self.parent)
        self._children[key] = new
        self.parent.append(node)
        self.token.append(token)
        self.depth.append(self.depth[node] + 1)
        self.context.append(self.context[node][1:] + (token,))
        return new

    def tokens(self, node: int) -> List[int]:
        """The token sequence of ``node`` (without the initial context)."""
        out: List[int] = []
        while node > 0:
            out.append(self.token[node])
            node = self.parent[node]
        return out[::-1]


def _logaddexp(a: float, b: float) -> float:
    """log(exp(a) + exp(b)) on Python floats."""
    hi, lo = (a, b) if a >= b else (b, a)
    if lo == -math.inf:
        return hi
    return hi + math.log1p(math.exp(lo - hi))


@torch.inference_mode()
def modified_beam_search(
    model: nn.Module, encoder_out: Tensor, encoder_out_lens: Tensor, beam: int = 4
) -> List[List[int]]:
    """icefall's modified beam search: batched, one symbol per frame.

    Each utterance keeps at most ``beam`` hypotheses (distinct token
    sequences) with scores. Per frame, every hypothesis is scored by the
    decoder and joiner (all hypotheses of all active utterances in one call);
    the candidate score of (hypothesis, token) is ``score + log_softmax``; the
    top ``beam`` candidates over all (hypothesis, token) pairs of the utterance
    are kept. Blank (and unk) keep the token sequence, another token appends
    itself. Candidates that end up with the same token sequence are merged
    with log-add, so with an unbounded beam a hypothesis' score is the log of
    the total probability of all one-symbol-per-frame alignments of its
    tokens. The answer maximises the length-normalised score
    ``score / (len(tokens) + context_size)`` (icefall divides by
    ``len(hyp.ys)``, which includes the ``context_size`` initial entries).

    Args:
      model: transducer with ``.decoder`` and ``.joiner``.
      encoder_out: (N, T, encoder_dim).
      encoder_out_lens: (N,) valid frames per utterance, each in [1, T].
      beam: hypotheses kept per utterance and frame (>= 1).
    Returns:
      N token-id lists (blank and unk removed), in input order.
    """
    lens = _check_inputs(encoder_out, encoder_out_lens)
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    with _eval_mode(model):
        return _modified_beam(model, encoder_out, lens, beam)


def _modified_beam(model: nn.Module, encoder_out: Tensor, lens: List[int], beam: int) -> List[List[int]]:
    """Body of :func:`modified_beam_search` (model already in eval mode)."""
    order, sorted_lens, batch_sizes = _sort_by_length(lens)
    enc = _project_sorted(model, encoder_out, order, sorted_lens[0])  # (N, T, J)
    search = ModifiedBeamSearch(
        *model_functions(model), _initial_context(model), enc.size(0), _skip_ids(model), beam
    )
    for t, b in enumerate(batch_sizes):
        search.step(enc[:b, t])
    return _unsort(search.results(), order)


class ModifiedBeamSearch:
    """icefall's modified beam search over ``num_streams`` streams, one frame per :meth:`step`.

    See :func:`modified_beam_search` for the algorithm: per frame, top
    ``beam`` (hypothesis, token) pairs per stream; blank/unk keep the token
    sequence; equal sequences merge by log-add; :meth:`results` picks the
    length-normalised best, ``score / (len(tokens) + context_size)``.

    Args:
      decoder_fn: contexts (M, context_size) -> projected decoder output (M, J).
      joiner_fn: (M, J), (M, J) -> logits (M, V).
      initial_context: the first decoder context of every stream (``context_size`` ids).
      num_streams: N.
      skip_ids: ids that are not emitted and keep the sequence (blank, unk).
      beam: hypotheses kept per stream and frame, >= 1.
    """

    def __init__(
        self,
        decoder_fn: DecoderFn,
        joiner_fn: JoinerFn,
        initial_context: Sequence[int],
        num_streams: int,
        skip_ids: Sequence[int],
        beam: int,
    ) -> None:
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        self.decoder_fn = decoder_fn
        self.joiner_fn = joiner_fn
        self.skip_ids = tuple(skip_ids)
        self.beam = beam
        self.context_size = len(initial_context)
        self.tree = _PrefixTree(initial_context)
        # hyps[i]: list of (sequence id, log-prob) of stream i.
        self.hyps: List[List[Tuple[int, float]]] = [[(0, 0.0)] for _ in range(num_streams)]

    def step(self, enc_t: Tensor) -> None:
        """Advance streams ``0 .. b-1`` by one frame.

        Args:
          enc_t: (b, J) projected encoder frame of each of the first b streams, b <= N.
        """
        b = enc_t.size(0)
        cand_scores, cand_index, vocab_size = self._top_candidates(enc_t, self.hyps[:b])
        for i in range(b):
            self.hyps[i] = _merge_candidates(
                self.hyps[i], cand_scores[i], cand_index[i], vocab_size, self.tree, self.skip_ids
            )

    def results(self) -> List[List[int]]:
        """Token ids of each stream's best hypothesis so far, by length-normalised score."""
        tree = self.tree
        best = [max(h, key=lambda nh: nh[1] / (tree.depth[nh[0]] + self.context_size))[0] for h in self.hyps]
        return [tree.tokens(node) for node in best]

    def _top_candidates(
        self, enc_t: Tensor, hyps: List[List[Tuple[int, float]]]
    ) -> Tuple[List[List[float]], List[List[int]], int]:
        """Score all hypotheses on one frame and take the per-stream top-``beam``.

        Args:
          enc_t: (b, J) projected encoder frame of each active stream.
          hyps: b lists of (sequence id, score), at most ``beam`` each.
        Returns:
          (scores, indexes, vocab_size): per stream, the top candidates' scores
          (descending) and their flat indexes ``slot * vocab_size + token`` into
          the (beam, vocab_size) grid of that stream.
        """
        device, beam, b = enc_t.device, self.beam, len(hyps)
        rows = [(i, slot, node, score) for i in range(b) for slot, (node, score) in enumerate(hyps[i])]
        flat_rows = torch.tensor([i * beam + slot for i, slot, _, _ in rows], device=device)
        utt = torch.tensor([i for i, _, _, _ in rows], device=device)
        contexts = torch.tensor([self.tree.context[node] for _, _, node, _ in rows], device=device)
        scores = torch.tensor([score for _, _, _, score in rows], device=device, dtype=torch.float32)

        dec = self.decoder_fn(contexts).to(device)
        log_probs = self.joiner_fn(enc_t[utt], dec).float().log_softmax(dim=-1)  # (H, V)
        vocab_size = log_probs.size(1)
        grid = log_probs.new_full((b * beam, vocab_size), -math.inf)
        grid[flat_rows] = log_probs + scores.unsqueeze(1)
        top_scores, top_index = grid.view(b, beam * vocab_size).topk(beam, dim=1)  # (b, beam)
        return top_scores.tolist(), top_index.tolist(), vocab_size


def _merge_candidates(
    hyps: List[Tuple[int, float]],
    scores: List[float],
    indexes: List[int],
    vocab_size: int,
    tree: _PrefixTree,
    skip: Tuple[int, ...],
) -> List[Tuple[int, float]]:
    """Turn one stream's top candidates into its next hypotheses.

    Blank/unk candidates keep the sequence, other tokens extend it; candidates
    with the same resulting sequence are merged with log-add.
    """
    merged: Dict[int, float] = {}
    for score, index in zip(scores, indexes):
        if score == -math.inf:
            continue  # fewer than ``beam`` real candidates
        node = hyps[index // vocab_size][0]
        token = index % vocab_size
        if token not in skip:
            node = tree.child(node, token)
        merged[node] = _logaddexp(merged[node], score) if node in merged else score
    return list(merged.items())


# --------------------------------------------------------------------------
# Fast beam search (k2's RNN-T decoding with a trivial graph, in PyTorch)
# --------------------------------------------------------------------------


@torch.inference_mode()
def fast_beam_search_one_best(
    model: nn.Module,
    encoder_out: Tensor,
    encoder_out_lens: Tensor,
    beam: float = 20.0,
    max_states: int = 64,
    max_contexts: int = 8,
) -> List[List[int]]:
    """k2's ``fast_beam_search`` with ``k2.trivial_graph(V-1)``, then the one-best path.

    A Viterbi beam search over decoder contexts, one symbol per frame. A
    state is the last ``context_size`` tokens (with the trivial graph the
    graph state is always the same, so states and contexts coincide). On each
    frame, for every state of every active utterance (all in one decoder and
    joiner call):

    1. arcs: blank keeps the state, token ``v > 0`` moves to the context
       shifted by ``v``; arc score = state score + log_softmax;
    2. first pruning pass (k2's ``DoFisrtPassPruning``): blank arcs are always
       kept, a token arc only if its score >= (best state score of the
       utterance on the previous frame) - ``beam``;
    3. states reached by several arcs keep the max score (Viterbi) and a
       back-pointer to that arc;
    4. second pass (k2's ``PruneTwice``): keep states within ``beam`` of the
       best new state, at most ``max_states`` of them, then at most
       ``max_contexts`` contexts; with the trivial graph that is the best
       ``min(max_states, max_contexts)`` states.

    The answer is the token sequence of the best-scoring surviving state at
    the utterance's last frame, followed back through the back-pointers. This
    is the shortest path of k2's lattice: the lattice keeps all surviving
    arcs, but the best path into each state is its max-score incoming arc.

    Differences from modified beam search (named, and tested): this is a
    Viterbi search -- it returns the tokens of the single most probable
    alignment, merges by the last ``context_size`` tokens with max, and
    applies no length normalisation; modified beam search log-adds over all
    alignments of a token sequence and normalises by length. Both emit at
    most one symbol per frame. Unk is an ordinary token here (k2's trivial
    graph has arcs for every id 1..V-1); only blank is removed from the output.

    Args:
      model: transducer with ``.decoder`` and ``.joiner``.
      encoder_out: (N, T, encoder_dim).
      encoder_out_lens: (N,) valid frames per utterance, each in [1, T].
      beam: log-probability beam (k2's ``RnntDecodingConfig.beam``).
      max_states: max states per utterance and frame.
      max_contexts: max decoder contexts per utterance and frame.
    Returns:
      N token-id lists (blank removed), in input order.
    """
    lens = _check_inputs(encoder_out, encoder_out_lens)
    if beam <= 0 or max_states < 1 or max_contexts < 1:
        raise ValueError(f"need beam > 0, max_states >= 1, max_contexts >= 1; got {beam}, {max_states}, {max_contexts}")
    with _eval_mode(model):
        return _fast_beam(model, encoder_out, lens, float(beam), min(max_states, max_contexts))


def _context_codes(contexts: Tensor, base: int) -> Tensor:
    """Integer code of each context: digits ``token + 1`` in base ``base``.

    Args:
      contexts: (..., context_size) int64, entries >= -1.
    Returns:
      (...,) int64.
    """
    code = torch.zeros(contexts.shape[:-1], dtype=torch.int64, device=contexts.device)
    for k in range(contexts.size(-1)):
        code = code * base + (contexts[..., k] + 1)
    return code


def _fast_beam(model: nn.Module, encoder_out: Tensor, lens: List[int], beam: float, max_active: int) -> List[List[int]]:
    """Body of :func:`fast_beam_search_one_best` (model already in eval mode).

    States of all active utterances live in a padded (b, K) grid, K =
    ``max_active``; empty slots score -inf.
    """
    device = encoder_out.device
    blank_id = int(model.decoder.blank_id)
    context_size = model.decoder.context_size
    vocab_size = model.decoder.vocab_size
    if (vocab_size + 1) ** context_size >= 2**62:
        raise ValueError(f"vocab_size={vocab_size} and context_size={context_size} overflow the int64 context code")
    order, sorted_lens, batch_sizes = _sort_by_length(lens)
    enc = _project_sorted(model, encoder_out, order, sorted_lens[0])  # (N, T, J)
    n, k_max = enc.size(0), max_active

    contexts = torch.tensor(_initial_context(model), device=device).repeat(n, k_max, 1)  # (N, K, c)
    scores = torch.full((n, k_max), -math.inf, dtype=torch.float64, device=device)
    scores[:, 0] = 0.0
    history: List[Tuple[Tensor, Tensor]] = []  # per frame: src slot, token

    for t, b in enumerate(batch_sizes):
        src, token, new_scores = _fast_beam_step(
            model, enc[:b, t], contexts[:b], scores[:b], beam, k_max, blank_id, vocab_size + 1
        )
        gathered = torch.gather(contexts[:b], 1, src.unsqueeze(-1).expand(-1, -1, context_size))
        shifted = torch.cat([gathered[..., 1:], token.unsqueeze(-1)], dim=-1)
        contexts[:b] = torch.where((token != blank_id).unsqueeze(-1), shifted, gathered)
        scores[:b] = new_scores
        history.append((src, token))

    tokens = _backtrack(history, sorted_lens, blank_id)
    return _unsort(tokens, order)


def _fast_beam_step(
    model: nn.Module,
    enc_t: Tensor,
    contexts: Tensor,
    scores: Tensor,
    beam: float,
    k_max: int,
    blank_id: int,
    base: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Advance all active utterances by one frame.

    Args:
      enc_t: (b, joiner_dim) projected encoder frame.
      contexts: (b, K, context_size) state contexts.
      scores: (b, K) float64 state scores, -inf for empty slots.
      base: ``vocab_size + 1``, the digit base of context codes.
    Returns:
      src: (b, K) int64 source slot of each new state's best arc.
      token: (b, K) int64 label of that arc (blank keeps the context).
      new_scores: (b, K) float64, sorted descending (slot 0 is the best
        state), -inf for empty slots.
    """
    b, _, context_size = contexts.shape
    dec = _decoder_out(model, contexts.reshape(b * k_max, context_size)).view(b, k_max, -1)
    log_probs = _log_probs(model, enc_t.unsqueeze(1), dec)  # (b, K, V)
    vocab_size = log_probs.size(-1)
    arc_scores = scores.unsqueeze(-1) + log_probs.double()  # (b, K, V)

    # First pass: token arcs must be within `beam` of the previous best state.
    prev_best = scores.max(dim=1).values.view(b, 1, 1)
    pruned = arc_scores < prev_best - beam
    pruned[..., blank_id] = False
    arc_scores = arc_scores.masked_fill(pruned, -math.inf)

    # A destination has at most K incoming arcs (one per source state), so the
    # best K distinct destinations are among the best K*K arcs.
    num_arcs = min(k_max * k_max, k_max * vocab_size)
    top_scores, top_index = arc_scores.view(b, k_max * vocab_size).topk(num_arcs, dim=1)  # (b, P)
    src = top_index // vocab_size
    token = top_index % vocab_size

    codes = _context_codes(contexts, base)  # (b, K)
    src_codes = torch.gather(codes, 1, src)
    shifted_codes = (src_codes % base ** (context_size - 1)) * base + token + 1
    dest = torch.where(token == blank_id, src_codes, shifted_codes)  # (b, P)

    keep = _first_occurrences(dest) & (top_scores > -math.inf)
    keep &= top_scores >= top_scores[:, :1] - beam  # second pass: beam on states
    rank = keep.cumsum(dim=1) - 1
    keep &= rank < k_max  # second pass: max_states / max_contexts

    # Compact the kept arcs (already in descending score order) into K slots.
    slot = torch.where(keep, rank, torch.full_like(rank, k_max))  # k_max = dump slot
    new_scores = scores.new_full((b, k_max + 1), -math.inf)
    new_src = src.new_zeros((b, k_max + 1))
    new_token = token.new_full((b, k_max + 1), blank_id)
    new_scores.scatter_(1, slot, torch.where(keep, top_scores, torch.full_like(top_scores, -math.inf)))
    new_src.scatter_(1, slot, torch.where(keep, src, torch.zeros_like(src)))
    new_token.scatter_(1, slot, torch.where(keep, token, torch.full_like(token, blank_id)))
    return new_src[:, :k_max], new_token[:, :k_max], new_scores[:, :k_max]


def _first_occurrences(keys: Tensor) -> Tensor:
    """Mask of entries whose key does not occur earlier in the same row.

    Args:
      keys: (b, P).
    Returns:
      (b, P) bool.
    """
    sorted_keys, perm = keys.sort(dim=1, stable=True)  # equal keys keep their order
    run_start = torch.ones_like(sorted_keys, dtype=torch.bool)
    run_start[:, 1:] = sorted_keys[:, 1:] != sorted_keys[:, :-1]
    return torch.zeros_like(run_start).scatter_(1, perm, run_start)


def _backtrack(history: List[Tuple[Tensor, Tensor]], sorted_lens: List[int], blank_id: int) -> List[List[int]]:
    """Follow back-pointers from each utterance's best final state (slot 0).

    Args:
      history: per frame t, (src (b_t, K), token (b_t, K)) of the new states.
      sorted_lens: frames per (sorted) utterance.
    Returns:
      per sorted utterance, the non-blank labels on its best path.
    """
    n = len(sorted_lens)
    sizes = [src.size(0) for src, _ in history]
    # One device-to-host copy for the whole history.
    src_all = torch.cat([src for src, _ in history]).cpu().split(sizes)
    token_all = torch.cat([token for _, token in history]).cpu().split(sizes)
    lens = torch.tensor(sorted_lens)
    cur = torch.zeros(n, dtype=torch.int64)
    labels = torch.full((len(history), n), blank_id, dtype=torch.int64)
    for t in range(len(history) - 1, -1, -1):
        b = sizes[t]
        cur[:b] = torch.where(lens[:b] == t + 1, torch.zeros_like(cur[:b]), cur[:b])
        rows = torch.arange(b)
        labels[t, :b] = token_all[t][rows, cur[:b]]
        cur[:b] = src_all[t][rows, cur[:b]]
    return [col[col != blank_id].tolist() for col in labels.t()]
