"""The Transducer: losses, one optimisation step, and the filter switch."""

import argparse
import itertools

import pytest
import torch

from conftest import tiny_transducer
from icefall_lite.nn.model import (
    MODEL_PRESETS,
    add_model_arguments,
    build_transducer,
    count_parameters,
    model_config_from_args,
)
from icefall_lite.nn.rnnt_loss import rnnt_loss_torchaudio
from icefall_lite.train.checkpoint import CheckpointError, load_state_dict_checked
from icefall_lite.train.optim import Eve


def _tiny(threshold: float = 25.0, seed: int = 0, use_ctc: bool = False):
    torch.manual_seed(seed)
    return tiny_transducer(
        vocab_size=12,
        encoder_dim=16,
        rnn_hidden_size=24,
        dim_feedforward=32,
        num_encoder_layers=2,
        decoder_dim=16,
        joiner_dim=16,
        grad_filter_threshold=threshold,
        use_ctc=use_ctc,
    )


def _batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 60, 80, generator=gen)
    x_lens = torch.tensor([60, 52, 45])
    y = [[3, 4, 5, 6], [1, 2], [7, 8, 9]]
    return x, x_lens, y


def _graph_node_names(tensor):
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def test_pruned_loss_with_full_range_equals_full_rnnt_loss():
    model = _tiny().eval()
    x, x_lens, y = _batch()
    simple, pruned, ctc, enc_lens = model(x, x_lens, y, prune_range=5)  # U + 1 <= 5: covers the lattice
    # Full lattice through the same joiner
    enc, enc_lens2, _ = model.encoder(x, x_lens)
    blank = model.decoder.blank_id
    sos_y = torch.tensor([[blank] + ids + [blank] * (4 - len(ids)) for ids in y])
    dec = model.decoder(sos_y)
    logits = model.joiner(enc.unsqueeze(2), dec.unsqueeze(1))
    targets = torch.tensor([ids + [0] * (4 - len(ids)) for ids in y], dtype=torch.int32)
    full = rnnt_loss_torchaudio(
        logits, targets, enc_lens2, torch.tensor([len(i) for i in y]), blank=blank, reduction="none"
    )
    torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-4)
    assert torch.equal(enc_lens, enc_lens2)
    assert ctc is None
    assert (simple > 0).all()


def test_one_step_lowers_the_loss():
    model = _tiny()
    x, x_lens, y = _batch()
    opt = Eve(model.parameters(), lr=0.01)
    model.train()
    torch.manual_seed(123)
    s, p, _, _ = model(x, x_lens, y, warmup=3.0)
    loss0 = 0.5 * s.sum() + p.sum()
    loss0.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        s1, p1, _, _ = model(x, x_lens, y, warmup=3.0)
    loss1 = 0.5 * s1.sum() + p1.sum()
    assert float(loss1) < float(loss0) - 1.0


def test_threshold_zero_has_no_filter_in_graph_and_same_gradients():
    x, x_lens, y = _batch()
    unfiltered = _tiny(threshold=0.0)
    filtered = _tiny(threshold=25.0)
    filtered.load_state_dict(unfiltered.state_dict())
    s, p, _, _ = unfiltered.eval()(x, x_lens, y)
    names = _graph_node_names(p.sum())
    assert not any("GradientFilter" in n for n in names)
    s_f, p_f, _, _ = filtered.eval()(x, x_lens, y)
    assert sum("GradientFilter" in n for n in _graph_node_names(p_f.sum())) == 2  # one per layer
    # Removing the filters from the filtered model gives bit-identical gradients
    # to the model built with threshold 0.
    for layer in filtered.encoder.encoder.layers:
        layer.lstm.grad_filter = None
    (0.5 * s.sum() + p.sum()).backward()
    s2, p2, _, _ = filtered(x, x_lens, y)
    (0.5 * s2.sum() + p2.sum()).backward()
    for (name, a), (_, b) in zip(unfiltered.named_parameters(), filtered.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_model_presets_and_overrides():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--model-preset", "icefall", "--num-encoder-layers", "3"])
    config = model_config_from_args(args, vocab_size=500, blank_id=0, num_features=80)
    assert config["num_encoder_layers"] == 3
    assert config["rnn_hidden_size"] == MODEL_PRESETS["icefall"]["rnn_hidden_size"]
    with pytest.raises(ValueError, match="--rnn-hidden-size"):
        model_config_from_args(
            parser.parse_args(["--encoder-dim", "512", "--rnn-hidden-size", "256"]),
            vocab_size=500,
            blank_id=0,
            num_features=80,
        )
    icefall = build_transducer(
        **model_config_from_args(
            parser.parse_args(["--model-preset", "icefall"]), vocab_size=500, blank_id=0, num_features=80
        )
    )
    # icefall's RESULTS.md gives 84,689,496 parameters for lstm_transducer_stateless3.
    assert count_parameters(icefall) == 84_689_496


@pytest.mark.parametrize("context_size", [2, 3])
def test_decoder_one_step_matches_the_padded_conv_and_a_loop(context_size):
    from icefall_lite.export.scaling_converter import convert_scaled_to_non_scaled
    from icefall_lite.nn.decoder import Decoder

    torch.manual_seed(0)
    decoder = Decoder(vocab_size=12, decoder_dim=8, blank_id=0, context_size=context_size)
    with torch.no_grad():
        decoder.conv.weight_scale.fill_(0.3)  # a non-trivial scale must be applied
    y = torch.tensor([[-1, 5, 7, 3][-context_size:], [4, 0, 9, 11][-context_size:]])
    with torch.no_grad():
        step = decoder(y, need_pad=False)  # (2, 1, 8)
        padded = decoder(y)[:, -1:]  # last position of the training path (nn.Conv1d kernel)
        emb = decoder.embedding(y.clamp(min=0)) * (y >= 0).unsqueeze(-1)  # (2, K, 8)
        w = decoder.conv.weight * decoder.conv.weight_scale.exp()  # (8, 1, K)
        loop = torch.zeros(2, 1, 8)
        for n in range(2):
            for c in range(8):
                loop[n, 0, c] = max(0.0, sum(float(w[c, 0, k] * emb[n, k, c]) for k in range(context_size)))
        plain = convert_scaled_to_non_scaled(decoder)(y, need_pad=False)
    torch.testing.assert_close(step, padded, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(step, loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, step, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=f"exactly context_size={context_size} tokens"):
        decoder(y[:, -1:], need_pad=False)


def _ctc_brute_force(log_probs: torch.Tensor, labels: list, blank: int) -> float:
    """-log sum over every frame labelling that collapses to ``labels`` (merge repeats, drop blanks)."""
    num_frames, vocab = log_probs.shape
    total = []
    for path in itertools.product(range(vocab), repeat=num_frames):
        collapsed = [k for i, k in enumerate(path) if k != blank and (i == 0 or path[i - 1] != k)]
        if collapsed == labels:
            total.append(sum(float(log_probs[t, k]) for t, k in enumerate(path)))
    return -float(torch.logsumexp(torch.tensor(total, dtype=torch.float64), 0))


def test_ctc_head_loss_equals_a_sum_over_all_alignments():
    torch.manual_seed(0)
    model = tiny_transducer(
        vocab_size=4,
        encoder_dim=8,
        rnn_hidden_size=8,
        dim_feedforward=16,
        num_encoder_layers=1,
        decoder_dim=8,
        joiner_dim=8,
        use_ctc=True,
    ).eval()
    encoder_out = torch.randn(3, 5, 8)
    lens = torch.tensor([5, 4, 3])
    y = [[1, 2], [3, 3], [2, 3, 1]]  # a repeat needs a blank between; 3 labels in 3 frames fit exactly
    with torch.no_grad():
        loss = model.ctc_loss(encoder_out, lens, y)
        log_probs = model.ctc_output(encoder_out)
    expected = [_ctc_brute_force(log_probs[i, : int(lens[i])], y[i], blank=0) for i in range(3)]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=loss.dtype), rtol=1e-5, atol=1e-5)
    # Too short for the labels (a repeat needs 3 frames): loss 0 instead of inf.
    short = model.ctc_loss(encoder_out[:1, :2], torch.tensor([2]), [[3, 3]])
    assert float(short) == 0.0


def test_ctc_head_adds_to_the_forward_and_is_dropped_when_loading_into_a_model_without_it():
    with_ctc = _tiny(use_ctc=True).eval()
    x, x_lens, y = _batch()
    s, p, ctc, enc_lens = with_ctc(x, x_lens, y)
    assert ctc.shape == (3,) and torch.isfinite(ctc).all() and (ctc > 0).all()
    enc, _, _ = with_ctc.encoder(x, x_lens)
    torch.testing.assert_close(ctc, with_ctc.ctc_loss(enc, enc_lens, y))
    without = _tiny(use_ctc=False, seed=5)
    load_state_dict_checked(without, with_ctc.state_dict(), "test")
    for name, value in without.state_dict().items():
        assert torch.equal(value, with_ctc.state_dict()[name]), name
    # The reverse still fails: a model with a CTC head needs its weights.
    with pytest.raises(CheckpointError, match="ctc_output"):
        load_state_dict_checked(_tiny(use_ctc=True), without.state_dict(), "test")


def test_blank_penalty_lowers_only_the_blank_logit():
    model = _tiny().eval()
    enc, dec = torch.randn(4, 16), torch.randn(4, 16)
    with torch.no_grad():
        plain = model.joiner(enc, dec)
        model.joiner.blank_penalty = 1.5
        penalised = model.joiner(enc, dec)
    blank = model.decoder.blank_id
    torch.testing.assert_close(penalised[:, blank], plain[:, blank] - 1.5)
    others = [k for k in range(plain.size(1)) if k != blank]
    assert torch.equal(penalised[:, others], plain[:, others])
