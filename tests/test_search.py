"""Tests of the searches in icefall_lite.decoding against brute-force decoders written here.

The model is a real Decoder + Joiner with fixed random weights; encoder
outputs are random. The reference decoders call the joiner with
``project_input=True`` (the search code pre-projects), so the projection
bookkeeping is checked too.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
import torch.nn as nn

from icefall_lite.nn.decoder import Decoder
from icefall_lite.nn.joiner import Joiner
from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search, greedy_search_batch
from icefall_lite.decoding.modified_beam_search import modified_beam_search

ENCODER_DIM, DECODER_DIM, JOINER_DIM = 16, 12, 20
BLANK = 0


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared 2-core machine
    spinning OpenMP workers make these tests 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TinyTransducer(nn.Module):
    """Just what the searches use: ``.decoder`` and ``.joiner``."""

    def __init__(self, vocab_size: int, context_size: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.decoder = Decoder(vocab_size, DECODER_DIM, blank_id=BLANK, context_size=context_size)
        self.joiner = Joiner(ENCODER_DIM, DECODER_DIM, JOINER_DIM, vocab_size)


def shift_output_bias(model: TinyTransducer, token: int, delta: float) -> None:
    """Add ``delta`` to the effective output bias of ``token``."""
    linear = model.joiner.output_linear
    with torch.no_grad():
        linear.bias[token] += delta / linear.bias_scale.exp()


def random_encoder_out(n: int, t: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, t, ENCODER_DIM, generator=gen) * scale


# --------------------------------------------------------------------------
# Reference decoders (plain loops)
# --------------------------------------------------------------------------


def initial_context(model: TinyTransducer) -> List[int]:
    return [-1] * (model.decoder.context_size - 1) + [BLANK]


@torch.no_grad()
def step_log_probs(model: TinyTransducer, frame: torch.Tensor, contexts: List[List[int]]) -> torch.Tensor:
    """(len(contexts), V) log-probs of one encoder frame (C,) after each context."""
    dec = model.decoder(torch.tensor(contexts), need_pad=False).squeeze(1)
    logits = model.joiner(frame.expand(len(contexts), -1), dec, project_input=True)
    return logits.log_softmax(dim=-1)


def argmax_loop(model: TinyTransducer, enc: torch.Tensor, skip: Sequence[int], max_sym: int = 1) -> List[int]:
    """Greedy decode of one utterance enc (T, C): at most ``max_sym`` symbols per frame."""
    context, hyp = initial_context(model), []
    for t in range(enc.size(0)):
        for _ in range(max_sym):
            y = int(step_log_probs(model, enc[t], [context])[0].argmax())
            if y in skip:
                break
            hyp.append(y)
            context = context[1:] + [y]
    return hyp


def enumerate_alignments(model: TinyTransducer, enc: torch.Tensor) -> List[Tuple[Tuple[int, ...], float]]:
    """Every one-symbol-per-frame alignment of enc (T, C): (tokens, log-prob)."""
    paths = [((), initial_context(model), 0.0)]
    for t in range(enc.size(0)):
        log_probs = step_log_probs(model, enc[t], [p[1] for p in paths]).tolist()
        grown = []
        for (tokens, context, score), row in zip(paths, log_probs):
            for v, lp in enumerate(row):
                if v == BLANK:
                    grown.append((tokens, context, score + lp))
                else:
                    grown.append((tokens + (v,), context[1:] + [v], score + lp))
        paths = grown
    return [(tokens, score) for tokens, _, score in paths]


def sequence_log_probs(alignments: List[Tuple[Tuple[int, ...], float]]) -> Dict[Tuple[int, ...], float]:
    """Total log-probability of each token sequence (log-sum over its alignments)."""
    grouped: Dict[Tuple[int, ...], List[float]] = defaultdict(list)
    for tokens, score in alignments:
        grouped[tokens].append(score)
    return {tokens: torch.logsumexp(torch.tensor(s, dtype=torch.float64), 0).item() for tokens, s in grouped.items()}


def best_normalised(totals: Dict[Tuple[int, ...], float], context_size: int) -> List[int]:
    """What modified beam search maximises: log P(tokens) / (len(tokens) + context_size)."""
    return list(max(totals, key=lambda y: totals[y] / (len(y) + context_size)))


def best_alignment(alignments: List[Tuple[Tuple[int, ...], float]]) -> List[int]:
    """What fast beam search maximises: the tokens of the single best alignment."""
    return list(max(alignments, key=lambda a: a[1])[0])


def modified_beam_loop(model: TinyTransducer, enc: torch.Tensor, beam: int) -> List[int]:
    """icefall's modified beam search for one utterance, with dicts keyed by token tuples."""
    c = model.decoder.context_size
    hyps: Dict[Tuple[int, ...], float] = {(): 0.0}
    for t in range(enc.size(0)):
        seqs = list(hyps)
        contexts = [(initial_context(model) + list(y))[-c:] for y in seqs]
        log_probs = step_log_probs(model, enc[t], contexts)
        candidates = [(hyps[y] + lp, y, v) for y, row in zip(seqs, log_probs.tolist()) for v, lp in enumerate(row)]
        merged: Dict[Tuple[int, ...], float] = {}
        for score, y, v in sorted(candidates, reverse=True)[:beam]:
            key = y if v == BLANK else y + (v,)
            merged[key] = float(torch.logaddexp(torch.tensor(merged[key]), torch.tensor(score))) if key in merged else score
        hyps = merged
    return list(max(hyps, key=lambda y: hyps[y] / (len(y) + c)))


def fast_beam_loop(
    model: TinyTransducer,
    enc: torch.Tensor,
    beam: float,
    max_states: int,
    max_contexts: int,
    second_pass_beam: bool = True,
) -> List[int]:
    """k2's fast_beam_search with a trivial graph, one utterance, dicts keyed by context.

    ``second_pass_beam=False`` drops the beam on new states (to show a case needs it).
    """
    states: Dict[Tuple[int, ...], Tuple[float, List[int]]] = {tuple(initial_context(model)): (0.0, [])}
    for t in range(enc.size(0)):
        contexts = list(states)
        log_probs = step_log_probs(model, enc[t], [list(ctx) for ctx in contexts])
        prev_best = max(score for score, _ in states.values())
        new: Dict[Tuple[int, ...], Tuple[float, List[int]]] = {}
        for ctx, row in zip(contexts, log_probs.tolist()):
            score, tokens = states[ctx]
            for v, lp in enumerate(row):
                arc_score = score + lp
                if v == BLANK:
                    dest, dest_tokens = ctx, tokens
                elif arc_score >= prev_best - beam:  # first pass
                    dest, dest_tokens = ctx[1:] + (v,), tokens + [v]
                else:
                    continue
                if dest not in new or arc_score > new[dest][0]:  # Viterbi merge
                    new[dest] = (arc_score, dest_tokens)
        best = max(score for score, _ in new.values())
        floor = best - beam if second_pass_beam else -math.inf
        survivors = sorted((kv for kv in new.items() if kv[1][0] >= floor), key=lambda kv: -kv[1][0])
        states = dict(survivors[: min(max_states, max_contexts)])
    return max(states.values(), key=lambda st: st[0])[1]


# --------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------


@pytest.mark.parametrize("context_size", [1, 2, 3])
def test_greedy_batch_equals_argmax_loop(context_size):
    model = TinyTransducer(vocab_size=20, context_size=context_size, seed=1)
    lens = torch.tensor([9, 4, 12, 1, 7])
    enc = random_encoder_out(5, 12, seed=2)
    hyps = greedy_search_batch(model, enc, lens)
    expected = [argmax_loop(model, enc[i, : lens[i]], skip=[BLANK]) for i in range(5)]
    assert hyps == expected
    assert sum(len(h) for h in hyps) > 10  # the case emits tokens


def test_greedy_skips_unk_like_icefall():
    model = TinyTransducer(vocab_size=10, seed=3)
    unk = 2
    shift_output_bias(model, unk, 3.0)  # make unk win often
    enc = random_encoder_out(3, 10, seed=4)
    lens = torch.tensor([10, 10, 6])
    with_unk_as_token = greedy_search_batch(model, enc, lens)
    assert any(unk in h for h in with_unk_as_token)  # the case really produces unk
    model.unk_id = unk
    hyps = greedy_search_batch(model, enc, lens)
    assert hyps == [argmax_loop(model, enc[i, : lens[i]], skip=[BLANK, unk]) for i in range(3)]
    assert all(unk not in h for h in hyps)
    assert [greedy_search(model, enc[i : i + 1, : lens[i]]) for i in range(3)] == hyps


def test_greedy_max_sym_per_frame_two_differs_and_matches_hand_loop():
    model = TinyTransducer(vocab_size=12, seed=5)
    shift_output_bias(model, BLANK, -1.5)  # blank loses sometimes even after an emission
    enc = random_encoder_out(1, 10, seed=6)
    one = greedy_search(model, enc, max_sym_per_frame=1)
    two = greedy_search(model, enc, max_sym_per_frame=2)
    assert one == argmax_loop(model, enc[0], skip=[BLANK], max_sym=1)
    assert two == argmax_loop(model, enc[0], skip=[BLANK], max_sym=2)
    assert one == greedy_search_batch(model, enc, torch.tensor([10]))[0]
    assert two != one
    assert len(one) < len(two) <= 20


# --------------------------------------------------------------------------
# Modified beam search
# --------------------------------------------------------------------------


@pytest.mark.parametrize("unk_id", [None, 3])
def test_modified_beam_one_equals_greedy(unk_id):
    model = TinyTransducer(vocab_size=15, seed=7)
    enc = random_encoder_out(4, 11, seed=8)
    lens = torch.tensor([11, 5, 8, 2])
    if unk_id is not None:
        shift_output_bias(model, unk_id, 1.0)
        assert any(unk_id in h for h in greedy_search_batch(model, enc, lens))  # unk does win
        model.unk_id = unk_id
    greedy = greedy_search_batch(model, enc, lens)
    assert modified_beam_search(model, enc, lens, beam=1) == greedy
    assert sum(len(h) for h in greedy) > 5


@pytest.mark.parametrize("beam", [2, 3, 4])
def test_modified_beam_equals_plain_icefall_loop(beam):
    model = TinyTransducer(vocab_size=9, seed=17)
    enc = random_encoder_out(3, 12, seed=18, scale=2.0)
    lens = torch.tensor([12, 7, 10])
    expected = [modified_beam_loop(model, enc[i, : lens[i]], beam) for i in range(3)]
    assert modified_beam_search(model, enc, lens, beam=beam) == expected


LATTICE_SEEDS = range(8)
LATTICE_VOCAB, LATTICE_FRAMES = 4, 5  # 4**5 = 1024 alignments per case


def lattice_case(seed: int) -> Tuple[TinyTransducer, torch.Tensor]:
    model = TinyTransducer(vocab_size=LATTICE_VOCAB, seed=100 + seed)
    return model, random_encoder_out(1, LATTICE_FRAMES, seed=200 + seed, scale=2.0)


@functools.lru_cache(maxsize=None)
def lattice_alignments(seed: int) -> List[Tuple[Tuple[int, ...], float]]:
    """enumerate_alignments of lattice_case(seed), computed once per session."""
    model, enc = lattice_case(seed)
    return enumerate_alignments(model, enc[0])


def test_modified_beam_returns_best_normalised_sequence_on_enumerated_lattice():
    """With a beam wide enough to prune nothing, modified beam search is exact:
    it returns argmax_y log P(y) / (len(y) + context_size), where P(y) sums all
    one-symbol-per-frame alignments of y."""
    lens = torch.tensor([LATTICE_FRAMES])
    normalisation_mattered = False
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        totals = sequence_log_probs(lattice_alignments(seed))
        expected = best_normalised(totals, model.decoder.context_size)
        assert modified_beam_search(model, enc, lens, beam=LATTICE_VOCAB**LATTICE_FRAMES) == [expected]
        normalisation_mattered |= expected != list(max(totals, key=totals.get))
    assert normalisation_mattered  # some case tells normalised from raw scores


def test_modified_beam_small_beam_is_approximate_but_sane():
    """Beam 4 (the default) keeps only 4 sequences; its answer must still be one
    of the enumerated sequences and score no better than the exact optimum."""
    lens = torch.tensor([LATTICE_FRAMES])
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        totals = sequence_log_probs(lattice_alignments(seed))
        c = model.decoder.context_size
        best = best_normalised(totals, c)
        got = tuple(modified_beam_search(model, enc, lens)[0])
        assert got in totals
        assert totals[got] / (len(got) + c) <= totals[tuple(best)] / (len(best) + c) + 1e-6


# --------------------------------------------------------------------------
# Fast beam search
# --------------------------------------------------------------------------

WIDE = dict(beam=1e9, max_states=64, max_contexts=64)  # > the 13 possible contexts


def test_fast_beam_wide_returns_best_single_alignment():
    lens = torch.tensor([LATTICE_FRAMES])
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        expected = best_alignment(lattice_alignments(seed))
        assert fast_beam_search_one_best(model, enc, lens, **WIDE) == [expected]


def test_fast_beam_vs_modified_beam_viterbi_versus_log_add():
    """Named difference: fast beam search is Viterbi (best single alignment),
    modified beam search log-adds alignments and length-normalises. Where the
    two criteria pick the same sequence the searches agree; the enumerated
    cases include both kinds."""
    lens = torch.tensor([LATTICE_FRAMES])
    agreed = differed = 0
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        alignments = lattice_alignments(seed)
        viterbi = best_alignment(alignments)
        log_add = best_normalised(sequence_log_probs(alignments), model.decoder.context_size)
        fast = fast_beam_search_one_best(model, enc, lens, **WIDE)[0]
        modified = modified_beam_search(model, enc, lens, beam=LATTICE_VOCAB**LATTICE_FRAMES)[0]
        assert (fast, modified) == (viterbi, log_add)
        if viterbi == log_add:
            agreed += 1
        else:
            differed += 1
    assert agreed > 0 and differed > 0


@pytest.mark.parametrize(
    "beam, max_states, max_contexts", [(20.0, 64, 8), (4.0, 8, 3), (1.5, 2, 8), (3.0, 5, 64), (2.0, 64, 64)]
)
def test_fast_beam_equals_plain_k2_loop(beam, max_states, max_contexts):
    model = TinyTransducer(vocab_size=12, seed=19)
    enc = random_encoder_out(3, 15, seed=20, scale=2.0)
    lens = torch.tensor([15, 9, 12])
    expected = [fast_beam_loop(model, enc[i, : lens[i]], beam, max_states, max_contexts) for i in range(3)]
    assert fast_beam_search_one_best(model, enc, lens, beam, max_states, max_contexts) == expected
    assert sum(len(h) for h in expected) > 10


def test_fast_beam_second_pass_beam_on_new_states():
    """k2 prunes new states more than `beam` below the frame's best (blank arcs
    escape the first pass, not this one). A strongly context-dependent model
    where that changes the answer."""
    model = TinyTransducer(vocab_size=8, seed=25)
    with torch.no_grad():
        model.decoder.embedding.weight.mul_(6.0)
    enc = random_encoder_out(1, 12, seed=75)
    expected = fast_beam_loop(model, enc[0], 1.0, 64, 64)
    assert expected != fast_beam_loop(model, enc[0], 1.0, 64, 64, second_pass_beam=False)
    assert fast_beam_search_one_best(model, enc, torch.tensor([12]), 1.0, 64, 64) == [expected]


@pytest.mark.parametrize("context_size", [1, 3])
def test_beam_searches_equal_plain_loops_for_other_context_sizes(context_size):
    model = TinyTransducer(vocab_size=12, context_size=context_size, seed=21)
    enc = random_encoder_out(3, 12, seed=22, scale=2.0)
    lens = torch.tensor([12, 7, 10])
    fast = [fast_beam_loop(model, enc[i, : lens[i]], 4.0, 8, 3) for i in range(3)]
    modified = [modified_beam_loop(model, enc[i, : lens[i]], 3) for i in range(3)]
    assert fast_beam_search_one_best(model, enc, lens, 4.0, 8, 3) == fast
    assert modified_beam_search(model, enc, lens, beam=3) == modified


@pytest.mark.parametrize("limits", [dict(max_states=1), dict(max_contexts=1)])
def test_fast_beam_with_one_state_is_greedy(limits):
    """Keeping one state per frame leaves only the best arc out of it: greedy."""
    model = TinyTransducer(vocab_size=20, seed=9)
    enc = random_encoder_out(4, 13, seed=10)
    lens = torch.tensor([13, 6, 10, 3])
    fast = fast_beam_search_one_best(model, enc, lens, **{**WIDE, **limits})
    assert fast == greedy_search_batch(model, enc, lens)


def test_fast_beam_first_pass_prunes_tokens_below_previous_best():
    """k2's first pass keeps a token arc only within `beam` of the previous
    frame's best state; blank arcs always survive. With a tiny beam every token
    arc is pruned and the answer is empty, while a wide beam emits tokens."""
    model = TinyTransducer(vocab_size=20, seed=11)
    enc = random_encoder_out(3, 9, seed=12)
    lens = torch.tensor([9, 9, 5])
    assert fast_beam_search_one_best(model, enc, lens, beam=1e-4) == [[], [], []]
    assert sum(len(h) for h in fast_beam_search_one_best(model, enc, lens)) > 0


def test_fast_beam_default_limits_match_wide_on_small_vocab():
    """With V=4 and context_size=2 there are at most 13 contexts; keeping 4 of
    them still finds the Viterbi answer on these cases (a sanity check of the
    code path that actually prunes)."""
    lens = torch.tensor([LATTICE_FRAMES])
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        wide = fast_beam_search_one_best(model, enc, lens, **WIDE)
        assert fast_beam_search_one_best(model, enc, lens, max_contexts=4) == wide


# --------------------------------------------------------------------------
# Batching, lengths, modes
# --------------------------------------------------------------------------

SEARCHES = {
    "greedy_search_batch": lambda m, e, n: greedy_search_batch(m, e, n),
    "modified_beam_search": lambda m, e, n: modified_beam_search(m, e, n, beam=4),
    "fast_beam_search_one_best": lambda m, e, n: fast_beam_search_one_best(m, e, n, beam=8.0, max_states=16, max_contexts=4),
}


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_variable_lengths_equal_decoding_each_utterance_alone(name):
    search = SEARCHES[name]
    model = TinyTransducer(vocab_size=25, seed=13)
    lens = torch.tensor([6, 14, 1, 14, 9])
    enc = random_encoder_out(5, 14, seed=14)
    for i, n in enumerate(lens.tolist()):
        enc[i, n:] = 1e3  # padding must not leak into the result
    batch = search(model, enc, lens)
    alone = [search(model, enc[i : i + 1, :n], torch.tensor([n]))[0] for i, n in enumerate(lens.tolist())]
    assert batch == alone
    assert sum(len(h) for h in batch) > 10


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_search_restores_training_mode_and_records_no_graph(name):
    model = TinyTransducer(vocab_size=10, seed=15)
    model.train()
    enc = random_encoder_out(2, 5, seed=16).requires_grad_(True)
    hyps = SEARCHES[name](model, enc, torch.tensor([5, 3]))
    assert model.training
    assert all(isinstance(h, list) and all(isinstance(x, int) for x in h) for h in hyps)
    assert enc.grad is None


def test_bad_lengths_are_rejected():
    model = TinyTransducer(vocab_size=10)
    enc = random_encoder_out(2, 5, seed=0)
    with pytest.raises(ValueError, match="encoder_out_lens"):
        greedy_search_batch(model, enc, torch.tensor([5, 0]))
    with pytest.raises(ValueError, match="encoder_out_lens"):
        modified_beam_search(model, enc, torch.tensor([6, 2]))
    with pytest.raises(ValueError, match=r"\(1, T, C\)"):
        greedy_search(model, enc)
