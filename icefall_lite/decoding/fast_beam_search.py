"""Fast beam search: k2's RNN-T decoding with a trivial graph, in PyTorch, then the one-best path.

Conventions (initial context, eval mode, sorting): :mod:`icefall_lite.decoding.search_utils`.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Tuple

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

    k2's ``RnntDecodingStreams`` (``k2/csrc/rnnt_decode.cu``) with the
    trivial graph, whose state 0 has a self-loop for every token 1..V-1 and a
    final arc (label -1) to the super-final state 1. A decoding state is
    (context, graph state): the last ``context_size`` tokens, and 0 or 1. On
    each frame, for every live state (context, 0) with score ``s`` of every
    active utterance (all in one decoder and joiner call), with ``lp`` the
    log_softmax of that context's joiner output:

    1. arcs: blank (the implicit epsilon self-loop) to (context, 0), score
       ``s + lp[0]``; token ``v`` to (context shifted by ``v``, 0), score
       ``s + lp[v]``; the final arc to (context, 1), score ``s + lp[0]``;
    2. first pruning pass (``DoFisrtPassPruning``): blank arcs are always kept;
       a token arc only if its score >= M - ``beam``, and a final arc only if
       ``s`` >= M - ``beam`` (its log-prob counts as 0 there), M being the
       utterance's best state score before the frame;
    3. a state reached by several arcs keeps the max score (Viterbi);
    4. second pass (``PruneTwice``): keep the states within ``beam`` of the
       best, at most ``max_states`` of them -- the final copies (context, 1)
       count against ``max_states`` -- then the states of the best
       ``max_contexts`` contexts (a context scores its best state).

    Final states have no arcs, so they end with the frame that made them.
    After the utterance's last frame, k2's ``format_output`` keeps only the
    final arcs of that frame (with score 0: the last frame's log-probs are
    ignored and no token is emitted on it) and the answer is the lattice's
    best path: the best state before the last frame whose final copy survived
    the last frame's pruning, followed back to the start. If none survived,
    the lattice has no final state and the answer is empty, as with k2
    (``allow_partial=False``, icefall's call). icefall's decode pads 35 tail
    frames, so the ignored last frame is padding there.

    Ties: states are ranked by score; k2 leaves the order of exactly equal
    scores to its sort, here the live copy (context, 0) ranks before the
    final copy (context, 1) of the same score (they tie whenever blank is the
    only arc into (context, 0)).

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
      max_states: max states per utterance and frame, final copies included.
      max_contexts: max decoder contexts per utterance and frame.
    Returns:
      N token-id lists (blank removed), in input order.
    """
    lens = check_inputs(encoder_out, encoder_out_lens)
    if beam <= 0 or max_states < 1 or max_contexts < 1:
        raise ValueError(f"need beam > 0, max_states >= 1, max_contexts >= 1; got {beam}, {max_states}, {max_contexts}")
    with eval_mode(model):
        return _fast_beam(model, encoder_out, lens, float(beam), max_states, max_contexts)


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


class _Step(NamedTuple):
    """One frame of :func:`_fast_beam_step` for b active utterances and K = max_contexts live slots."""

    src: Tensor  # (b, K) int64: source slot of each new live state's best arc
    token: Tensor  # (b, K) int64: label of that arc (blank keeps the context)
    scores: Tensor  # (b, K) float64: new live scores, descending, -inf for empty slots
    final_kept: Tensor  # (b, K) bool: the source slot's final copy survived this frame's pruning


def _fast_beam(
    model: nn.Module, encoder_out: Tensor, lens: List[int], beam: float, max_states: int, max_contexts: int
) -> List[List[int]]:
    """Body of :func:`fast_beam_search_one_best` (model already in eval mode).

    The live states (context, 0) of all active utterances live in a padded
    (b, K) grid, K = ``max_contexts``; empty slots score -inf.
    """
    device = encoder_out.device
    blank_id = int(model.decoder.blank_id)
    context_size = model.decoder.context_size
    vocab_size = model.decoder.vocab_size
    if (vocab_size + 1) ** context_size >= 2**62:
        raise ValueError(f"vocab_size={vocab_size} and context_size={context_size} overflow the int64 context code")
    order, sorted_lens, batch_sizes = sort_by_length(lens)
    enc = project_sorted(model, encoder_out, order, sorted_lens[0])  # (N, T, J)
    n, k_max = enc.size(0), max_contexts

    contexts = torch.tensor(model_initial_context(model), device=device).repeat(n, k_max, 1)  # (N, K, c)
    scores = torch.full((n, k_max), -math.inf, dtype=torch.float64, device=device)
    scores[:, 0] = 0.0
    history: List[Tuple[Tensor, Tensor]] = []  # per frame: src slot, token
    end_slots = torch.full((n,), -1, dtype=torch.int64, device=device)  # -1: no final arc survived
    last_frame_rows: Dict[int, List[int]] = {}  # frame -> the (sorted) utterances that end on it
    for i, length in enumerate(sorted_lens):
        last_frame_rows.setdefault(length - 1, []).append(i)

    for t, b in enumerate(batch_sizes):
        step = _fast_beam_step(model, enc[:b, t], contexts[:b], scores[:b], beam, max_states, blank_id, vocab_size + 1)
        # Utterances whose last frame this is: the best source state whose final copy survived.
        if t in last_frame_rows:
            rows = torch.tensor(last_frame_rows[t], device=device)
            final_scores = scores[rows].masked_fill(~step.final_kept[rows], -math.inf)
            best_score, best_slot = final_scores.max(dim=1)
            end_slots[rows] = torch.where(best_score > -math.inf, best_slot, torch.full_like(best_slot, -1))
        gathered = torch.gather(contexts[:b], 1, step.src.unsqueeze(-1).expand(-1, -1, context_size))
        shifted = torch.cat([gathered[..., 1:], step.token.unsqueeze(-1)], dim=-1)
        contexts[:b] = torch.where((step.token != blank_id).unsqueeze(-1), shifted, gathered)
        scores[:b] = step.scores
        history.append((step.src, step.token))

    tokens = _backtrack(history, sorted_lens, end_slots.cpu(), blank_id)
    return unsort(tokens, order)


def _fast_beam_step(
    model: nn.Module,
    enc_t: Tensor,
    contexts: Tensor,
    scores: Tensor,
    beam: float,
    max_states: int,
    blank_id: int,
    base: int,
) -> _Step:
    """Advance all active utterances by one frame (k2's ``Advance``).

    Args:
      enc_t: (b, joiner_dim) projected encoder frame.
      contexts: (b, K, context_size) contexts of the live states.
      scores: (b, K) float64 live state scores, -inf for empty slots.
      max_states: k2's max_states (live and final states together).
      base: ``vocab_size + 1``, the digit base of context codes.
    """
    b, k_max, context_size = contexts.shape
    dec = model_decoder_out(model, contexts.reshape(b * k_max, context_size)).view(b, k_max, -1)
    log_probs = joiner_log_probs(model, enc_t.unsqueeze(1), dec).double()  # (b, K, V)
    vocab_size = log_probs.size(-1)
    arc_scores = scores.unsqueeze(-1) + log_probs  # (b, K, V)

    # First pass: token arcs within `beam` of the previous best state; blank arcs always.
    prev_best = scores.max(dim=1, keepdim=True).values  # (b, 1)
    pruned = arc_scores < prev_best.unsqueeze(-1) - beam
    pruned[..., blank_id] = False
    arc_scores = arc_scores.masked_fill(pruned, -math.inf)
    # Final arcs: first pass on the source score, then the blank log-prob.
    final_scores = (scores + log_probs[..., blank_id]).masked_fill(~(scores >= prev_best - beam), -math.inf)

    # A live destination has at most K incoming arcs (one per source state), so
    # the best max_states distinct destinations are among the best K*max_states arcs.
    num_arcs = min(k_max * max_states, k_max * vocab_size)
    top_scores, top_index = arc_scores.view(b, k_max * vocab_size).topk(num_arcs, dim=1)  # (b, P), descending
    src = top_index // vocab_size
    token = top_index % vocab_size

    codes = _context_codes(contexts, base)  # (b, K)
    src_codes = torch.gather(codes, 1, src)
    shifted_codes = (src_codes % base ** (context_size - 1)) * base + token + 1
    dest = torch.where(token == blank_id, src_codes, shifted_codes)  # (b, P)
    live = _first_occurrences(dest) & (top_scores > -math.inf)  # the Viterbi arc of each live destination

    # Second pass, states: live and final states ranked together (stable sort: on a
    # tie the live state, listed first, ranks first), beam, then max_states.
    state_scores = torch.cat([top_scores.masked_fill(~live, -math.inf), final_scores], dim=1)  # (b, P + K)
    ranked = state_scores.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(ranked).scatter_(
        1, ranked, torch.arange(ranked.size(1), device=ranked.device).expand_as(ranked)
    )
    best = state_scores.max(dim=1, keepdim=True).values
    kept = (state_scores > -math.inf) & (state_scores >= best - beam) & (rank < max_states)
    live_kept, final_kept = kept[:, : top_scores.size(1)], kept[:, top_scores.size(1) :]
    # Second pass, contexts: a context scores its best state, which is its live state
    # (a final copy never beats the blank arc into its own context), so keep the
    # best K contexts with a live state; a final copy needs its context kept.
    live_kept &= live_kept.cumsum(dim=1) <= k_max
    kept_codes = dest.masked_fill(~live_kept, -1)
    final_kept &= (codes.unsqueeze(-1) == kept_codes.unsqueeze(1)).any(dim=-1)

    # Compact the kept live states (already in descending score order) into K slots.
    slot = torch.where(live_kept, live_kept.cumsum(dim=1) - 1, torch.full_like(src, k_max))  # k_max = dump slot
    new_scores = scores.new_full((b, k_max + 1), -math.inf)
    new_src = src.new_zeros((b, k_max + 1))
    new_token = token.new_full((b, k_max + 1), blank_id)
    new_scores.scatter_(1, slot, top_scores.masked_fill(~live_kept, -math.inf))
    new_src.scatter_(1, slot, src.masked_fill(~live_kept, 0))
    new_token.scatter_(1, slot, token.masked_fill(~live_kept, blank_id))
    return _Step(new_src[:, :k_max], new_token[:, :k_max], new_scores[:, :k_max], final_kept)


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


def _backtrack(
    history: List[Tuple[Tensor, Tensor]], sorted_lens: List[int], end_slots: Tensor, blank_id: int
) -> List[List[int]]:
    """Follow back-pointers from each utterance's end state.

    The end state of an utterance of L frames is a live state after L - 1
    frames (``end_slots``, -1 when no final arc survived: empty answer); the
    tokens are the labels of the arcs into it on frames 0 .. L - 2.

    Args:
      history: per frame t, (src (b_t, K), token (b_t, K)) of the new states.
      sorted_lens: frames per (sorted) utterance.
      end_slots: (N,) int64 on the CPU.
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
    for t in range(len(history) - 2, -1, -1):
        b = sizes[t]
        cur[:b] = torch.where(lens[:b] == t + 2, end_slots[:b].clamp(min=0), cur[:b])
        rows = torch.arange(b)
        on_path = lens[:b] >= t + 2  # frame t is before the utterance's last frame
        labels[t, :b] = torch.where(on_path, token_all[t][rows, cur[:b]], torch.full_like(cur[:b], blank_id))
        cur[:b] = src_all[t][rows, cur[:b]]
    hyps = [col[col != blank_id].tolist() for col in labels.t()]
    return [hyp if end >= 0 else [] for hyp, end in zip(hyps, end_slots.tolist())]


__all__ = ["fast_beam_search_one_best"]
