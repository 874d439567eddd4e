"""icefall's modified beam search: at most one symbol per frame, hypotheses merged by token sequence.

Conventions (initial context, eval mode, sorting, blank/unk): :mod:`icefall_lite.decoding.search_utils`.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.decoding.search_utils import (
    DecoderFn,
    FrameSearch,
    JoinerFn,
    check_inputs,
    eval_mode,
    model_functions,
    model_initial_context,
    model_skip_ids,
    search_sorted,
)


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
    lens = check_inputs(encoder_out, encoder_out_lens)
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    with eval_mode(model):
        return _modified_beam(model, encoder_out, lens, beam)


def _modified_beam(model: nn.Module, encoder_out: Tensor, lens: List[int], beam: int) -> List[List[int]]:
    """Body of :func:`modified_beam_search` (model already in eval mode)."""
    return search_sorted(
        model,
        encoder_out,
        lens,
        lambda n: ModifiedBeamSearch(
            *model_functions(model), model_initial_context(model), n, model_skip_ids(model), beam
        ),
    )


class ModifiedBeamSearch(FrameSearch):
    """icefall's modified beam search over ``num_streams`` streams, one frame per :meth:`step`.

    See :func:`modified_beam_search` for the algorithm: per frame, top
    ``beam`` (hypothesis, token) pairs per stream; blank/unk keep the token
    sequence; equal sequences merge by log-add; :meth:`results` picks the
    length-normalised best, ``score / (len(tokens) + context_size)``.

    Args (``decoder_fn``, ``joiner_fn``, ``skip_ids``: see :class:`~icefall_lite.decoding.search_utils.FrameSearch`;
    blank/unk keep the token sequence):
      initial_context: the first decoder context of every stream (``context_size`` ids).
      num_streams: N.
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
        super().__init__(decoder_fn, joiner_fn, skip_ids)
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


__all__ = ["modified_beam_search", "ModifiedBeamSearch"]
