"""Fast beam search: k2's RNN-T decoding with a trivial graph, in PyTorch, then the one-best path.

Conventions (initial context, eval mode, sorting): :mod:`icefall_lite.decoding.search_utils`.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from icefall_lite.decoding.search_utils import (
    check_inputs,
    eval_mode,
    joiner_log_probs,
    model_decoder_out,
    model_initial_context,
    project_sorted,
    sort_by_length,
    unsort,
)


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
    lens = check_inputs(encoder_out, encoder_out_lens)
    if beam <= 0 or max_states < 1 or max_contexts < 1:
        raise ValueError(f"need beam > 0, max_states >= 1, max_contexts >= 1; got {beam}, {max_states}, {max_contexts}")
    with eval_mode(model):
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
    order, sorted_lens, batch_sizes = sort_by_length(lens)
    enc = project_sorted(model, encoder_out, order, sorted_lens[0])  # (N, T, J)
    n, k_max = enc.size(0), max_active

    contexts = torch.tensor(model_initial_context(model), device=device).repeat(n, k_max, 1)  # (N, K, c)
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
    return unsort(tokens, order)


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
    dec = model_decoder_out(model, contexts.reshape(b * k_max, context_size)).view(b, k_max, -1)
    log_probs = joiner_log_probs(model, enc_t.unsqueeze(1), dec)  # (b, K, V)
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


__all__ = ["fast_beam_search_one_best"]
