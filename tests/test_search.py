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

from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search, greedy_search_batch
from icefall_lite.decoding.modified_beam_search import modified_beam_search
from icefall_lite.nn.decoder import Decoder
from icefall_lite.nn.joiner import Joiner

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
        self.joiner = Joiner(ENCODER_DIM, DECODER_DIM, JOINER_DIM, vocab_size, blank_id=BLANK)


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
            merged[key] = (
                float(torch.logaddexp(torch.tensor(merged[key]), torch.tensor(score))) if key in merged else score
            )
        hyps = merged
    return list(max(hyps, key=lambda y: hyps[y] / (len(y) + c)))


def fast_beam_loop(
    model: TinyTransducer,
    enc: torch.Tensor,
    beam: float,
    max_states: int,
    max_contexts: int,
    second_pass_beam: bool = True,
    count_final_states: bool = True,
) -> List[int]:
    """k2's RnntDecodingStreams with ``k2.trivial_graph(V-1)`` for one utterance, step by step as
    k2/csrc/rnnt_decode.cu runs it: states (context, graph state) with graph state 1 the super-final
    state, explicit arcs (blank self-loop, token self-loops 1..V-1, the final arc scored with the
    blank log-prob), the first pass, the Viterbi max per state, PruneTwice (states, then contexts),
    then format_output's lattice (the last frame keeps only its final arcs, scored 0) and its best
    path found by a Viterbi pass over the lattice.

    Switches (to show a case needs the real rule): ``second_pass_beam=False`` drops the beam on new
    states; ``count_final_states=False`` lets only live states count against ``max_states``.
    """
    start = (tuple(initial_context(model)), 0)
    states: Dict[Tuple[Tuple[int, ...], int], float] = {start: 0.0}
    lattice = []  # per frame: the kept arcs (src, dest, label, weight)
    vocab = model.joiner.output_linear.out_features
    for t in range(enc.size(0)):
        live = [st for st in states if st[1] == 0]  # the super-final state has no arcs
        prev_best = max(states.values())
        arcs = []
        for st, row in zip(live, step_log_probs(model, enc[t], [list(st[0]) for st in live]).tolist()):
            ctx, score = st[0], states[st]
            arcs.append((st, (ctx, 0), BLANK, row[BLANK]))  # kept by the first pass
            arcs += [
                (st, (ctx[1:] + (v,), 0), v, row[v]) for v in range(1, vocab) if score + row[v] >= prev_best - beam
            ]
            if score >= prev_best - beam:  # the final arc's log-prob counts as 0 in the first pass
                arcs.append((st, (ctx, 1), -1, row[BLANK]))
        dest: Dict[Tuple[Tuple[int, ...], int], float] = {}
        for src, d, _, weight in arcs:
            dest[d] = max(dest.get(d, -math.inf), states[src] + weight)
        floor = max(dest.values()) - beam if second_pass_beam else -math.inf
        ranked = sorted((d for d in dest if dest[d] >= floor), key=lambda d: (-dest[d], d[1]))  # tie: live first
        if count_final_states:
            kept = ranked[:max_states]
        else:
            kept = [d for d in ranked if d[1] == 0][:max_states] + [d for d in ranked if d[1] == 1]
        context_score: Dict[Tuple[int, ...], float] = {}
        for d in kept:
            context_score[d[0]] = max(context_score.get(d[0], -math.inf), dest[d])
        kept_contexts = set(sorted(context_score, key=lambda c: -context_score[c])[:max_contexts])
        states = {d: dest[d] for d in kept if d[0] in kept_contexts}
        lattice.append([arc for arc in arcs if arc[1] in states])

    # format_output + one-best: frames 0..T-2 as kept (arcs into final states lead nowhere),
    # then the last frame's final arcs with score 0.
    best: Dict[Tuple[Tuple[int, ...], int], Tuple[float, List[int]]] = {start: (0.0, [])}
    for frame in lattice[:-1]:
        reached: Dict[Tuple[Tuple[int, ...], int], Tuple[float, List[int]]] = {}
        for src, d, label, weight in frame:
            if src in best and d[1] == 0:
                score = best[src][0] + weight
                if d not in reached or score > reached[d][0]:
                    reached[d] = (score, best[src][1] + ([label] if label != BLANK else []))
        best = reached
    ends = [best[src] for src, _, label, _ in lattice[-1] if label == -1 and src in best]
    return max(ends, key=lambda end: end[0])[1] if ends else []


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

WIDE = dict(beam=1e9, max_states=64, max_contexts=64)  # > the 13 possible contexts and their 13 final copies


def with_tail_frame(enc: torch.Tensor) -> torch.Tensor:
    """enc (N, T, C) with one more frame: k2 ignores an utterance's last frame (as icefall's tail padding does)."""
    return torch.cat([enc, torch.zeros_like(enc[:, :1])], dim=1)


def test_fast_beam_wide_returns_best_single_alignment_of_all_but_the_last_frame():
    """k2's lattice keeps only final arcs on the last frame, scored 0: the answer is the best
    alignment of the frames before it. Some cases' best alignment over all frames differs."""
    last_frame_mattered = False
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        expected = best_alignment(lattice_alignments(seed))
        assert fast_beam_search_one_best(model, with_tail_frame(enc), torch.tensor([LATTICE_FRAMES + 1]), **WIDE) == [
            expected
        ]
        got = fast_beam_search_one_best(model, enc, torch.tensor([LATTICE_FRAMES]), **WIDE)
        assert got == [best_alignment(enumerate_alignments(model, enc[0, :-1]))]
        last_frame_mattered |= got != [expected]
    assert last_frame_mattered


def test_fast_beam_vs_modified_beam_viterbi_versus_log_add():
    """Named difference: fast beam search is Viterbi (best single alignment),
    modified beam search log-adds alignments and length-normalises. Where the
    two criteria pick the same sequence the searches agree; the enumerated
    cases include both kinds."""
    agreed = differed = 0
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        alignments = lattice_alignments(seed)
        viterbi = best_alignment(alignments)
        log_add = best_normalised(sequence_log_probs(alignments), model.decoder.context_size)
        fast = fast_beam_search_one_best(model, with_tail_frame(enc), torch.tensor([LATTICE_FRAMES + 1]), **WIDE)[0]
        modified = modified_beam_search(model, enc, torch.tensor([LATTICE_FRAMES]), beam=LATTICE_VOCAB**LATTICE_FRAMES)[
            0
        ]
        assert (fast, modified) == (viterbi, log_add)
        if viterbi == log_add:
            agreed += 1
        else:
            differed += 1
    assert agreed > 0 and differed > 0


def blank_leaning_model(blank_bias: float) -> TinyTransducer:
    """The reference cases' model with blank made likelier by ``blank_bias`` nats, as in trained models
    (with a random model blank is rare, and k2's final copies, scored with blank, lose out to max_states)."""
    model = TinyTransducer(vocab_size=12, seed=19)
    shift_output_bias(model, BLANK, blank_bias)
    return model


@pytest.mark.parametrize("blank_bias", [0.0, 1.5])
@pytest.mark.parametrize(
    "beam, max_states, max_contexts",
    [
        (20.0, 64, 8),
        (4.0, 8, 4),
        (4.0, 8, 3),
        (20.0, 5, 4),
        (1.5, 2, 8),
        (3.0, 5, 64),
        (2.0, 64, 64),
        (1e9, 1, 64),
        (1e9, 64, 1),
    ],
)
def test_fast_beam_equals_k2_reference(beam, max_states, max_contexts, blank_bias):
    model = blank_leaning_model(blank_bias)
    enc = random_encoder_out(3, 15, seed=20, scale=2.0)
    lens = torch.tensor([15, 9, 12])
    expected = [fast_beam_loop(model, enc[i, : lens[i]], beam, max_states, max_contexts) for i in range(3)]
    assert fast_beam_search_one_best(model, enc, lens, beam, max_states, max_contexts) == expected


def test_fast_beam_reference_cases_emit_tokens():
    """The reference comparison is not between empty answers: the defaults on the random model, and
    icefall's RESULTS settings (beam 4, 4 contexts, 8 states) on the blank-leaning one."""
    enc = random_encoder_out(3, 15, seed=20, scale=2.0)
    for blank_bias, limits in [(0.0, (20.0, 64, 8)), (1.5, (4.0, 8, 4))]:
        model = blank_leaning_model(blank_bias)
        hyps = [fast_beam_loop(model, enc[i], *limits) for i in range(3)]
        assert sum(len(h) for h in hyps) >= 5 and sum(1 for h in hyps if h) >= 2, (blank_bias, limits, hyps)


def test_fast_beam_final_copies_count_against_max_states():
    """k2 ranks the final copies (context, 1) with the live states under max_states, so with
    max_states < 2 * max_contexts they crowd live states (and each other) out. Cases where counting
    them changes the answer; the search follows k2."""
    model = blank_leaning_model(2.0)
    enc = random_encoder_out(6, 15, seed=20, scale=2.0)
    lens = torch.full((6,), 15)
    limits = (20.0, 5, 4)
    k2_rule = [fast_beam_loop(model, enc[i], *limits) for i in range(6)]
    live_only = [fast_beam_loop(model, enc[i], *limits, count_final_states=False) for i in range(6)]
    assert k2_rule != live_only and any(k2_rule)
    assert fast_beam_search_one_best(model, enc, lens, *limits) == k2_rule


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


def test_fast_beam_with_one_context_is_greedy_until_the_last_frame():
    """One context per frame leaves the best arc out of it: greedy search. On the last frame the
    final copy survives only if its context does, i.e. if that frame's best arc keeps the context
    (blank); otherwise the lattice has no final state and the answer is empty (k2's, allow_partial=False)."""
    model = TinyTransducer(vocab_size=20, seed=9)
    shift_output_bias(model, BLANK, 1.0)  # blank likely enough that both outcomes occur
    enc = random_encoder_out(8, 13, seed=10)
    lens = [13, 6, 10, 3, 13, 7, 2, 11]
    fast = fast_beam_search_one_best(model, enc, torch.tensor(lens), **{**WIDE, "max_contexts": 1})
    expected = []
    for i, n in enumerate(lens):
        hyp = argmax_loop(model, enc[i, : n - 1], skip=[BLANK])
        context = (initial_context(model) + hyp)[-model.decoder.context_size :]
        last = int(step_log_probs(model, enc[i, n - 1], [context])[0].argmax())
        keeps_context = last == BLANK or context[1:] + [last] == context
        expected.append(hyp if keeps_context else [])
    assert fast == expected
    assert any(expected) and not all(expected)


def test_fast_beam_first_pass_prunes_tokens_below_previous_best():
    """k2's first pass keeps a token arc only within `beam` of the previous
    frame's best state; blank arcs always survive. With a tiny beam every token
    arc is pruned and the answer is empty, while a wide beam emits tokens."""
    model = TinyTransducer(vocab_size=20, seed=11)
    enc = random_encoder_out(3, 9, seed=12)
    lens = torch.tensor([9, 9, 5])
    assert fast_beam_search_one_best(model, enc, lens, beam=1e-4) == [[], [], []]
    assert sum(len(h) for h in fast_beam_search_one_best(model, enc, lens)) > 0


def test_fast_beam_pruned_contexts_on_small_vocab_equal_k2_reference():
    """V=4 and context_size=2 give at most 13 contexts; keeping 4 (and 8 states) prunes on every
    lattice case, and the answers are the reference's."""
    lens = torch.tensor([LATTICE_FRAMES])
    for seed in LATTICE_SEEDS:
        model, enc = lattice_case(seed)
        expected = fast_beam_loop(model, enc[0], 20.0, 8, 4)
        assert fast_beam_search_one_best(model, enc, lens, beam=20.0, max_states=8, max_contexts=4) == [expected]


# --------------------------------------------------------------------------
# Batching, lengths, modes
# --------------------------------------------------------------------------

SEARCHES = {
    "greedy_search_batch": lambda m, e, n: greedy_search_batch(m, e, n),
    "modified_beam_search": lambda m, e, n: modified_beam_search(m, e, n, beam=4),
    "fast_beam_search_one_best": lambda m, e, n: fast_beam_search_one_best(
        m, e, n, beam=8.0, max_states=32, max_contexts=4
    ),
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
