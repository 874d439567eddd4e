"""What padding a batch to a static shape (what a CUDA graph per shape needs: extra frames, extra token
positions, dummy rows) does to a training step: nothing. The ActivationBalancers' and the GradientFilters'
statistics count the real rows' frames up to the longest real utterance (as icefall's count the batch lhotse
pads to its longest utterance), and the dummy rows get zero loss; so a padded batch gives the batch's losses
and every gradient, with the balancers acting and the filter filtering."""

from dataclasses import replace

import pytest
import torch

import icefall_lite.nn.encoder as encoder_module
from conftest import tiny_training_setup
from icefall_lite.data.static_batch import BatchTensors, batch_tensors, pad_to, static_shape
from icefall_lite.nn.scaling import ActivationBalancer

LSTM_0 = "encoder.encoder.layers.0.lstm.weight_ih_l0"


def _batch() -> dict:
    """Four utterances of 110, 100, 90 and 75 frames padded as lhotse pads (log 1e-10) to the longest."""
    gen = torch.Generator().manual_seed(5)
    lengths = [110, 100, 90, 75]
    x = torch.full((4, 110, 80), -23.025850929940457)
    for i, n in enumerate(lengths):
        x[i, :n] = torch.randn(n, 80, generator=gen)
    texts = ["HELLO THERE", "A CAT", "THE END", "THERE IS A CAT"]
    return {"inputs": x, "supervisions": {"text": texts, "num_frames": torch.tensor(lengths)}}


def _model(bpe_model: str, *flags: str):
    """The tiny model in training mode, its ActivationBalancers acting at every step (not at random), in float64
    (its losses too): float32's rounding of sums over the batch's shape (1.5e-6 to 2.5e-6 of the scalar
    log-scales' gradients, which add up every weight's; with the losses' recursions alone in float32, 2.5e-6 on
    an AMD EPYC) would hide what padding does."""
    params, model, sp = tiny_training_setup(bpe_model, *flags)
    for module in model.modules():
        if isinstance(module, ActivationBalancer):
            module.prob = 1.0
    return params, model.double().train(), sp


def _inputs(sp) -> BatchTensors:
    inputs = batch_tensors(_batch(), sp)
    return replace(inputs, features=inputs.features.double())


def _step(params, model, inputs: BatchTensors):
    """Per-utterance (simple, pruned, ctc) losses of the real rows and every parameter's gradient, of the
    training objective (warmed up: every loss counts)."""
    model.zero_grad(set_to_none=True)
    simple, pruned, ctc, _ = model(
        inputs.features,
        inputs.feature_lens,
        inputs.tokens,
        prune_range=params.prune_range,
        am_scale=params.am_scale,
        lm_scale=params.lm_scale,
        warmup=3.0,
        y_lens=inputs.token_lens,
        real=inputs.real,
    )
    losses = [simple, pruned] + ([] if ctc is None else [ctc])
    sum(loss.sum() for loss in losses).backward()
    real = inputs.real
    assert all(float(loss[~real].detach().abs().sum()) == 0.0 for loss in losses)  # a dummy row's loss is 0
    return [loss[real].detach() for loss in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _largest_difference(a, b) -> float:
    (losses_a, grads_a), (losses_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    loss_gap = max(float(((x - y).abs() / y.abs()).max()) for x, y in zip(losses_a, losses_b))
    return max(loss_gap, max(_relative(grads_a[n], grads_b[n]) for n in grads_b))


@pytest.mark.parametrize(
    "flags",
    [
        ("--grad-filter-threshold", "1.1"),  # the soft filter scaling every sequence (its median: real rows)
        ("--grad-filter-threshold", "1.1", "--grad-filter-mode", "hard-mask", "--ctc-loss-scale", "0.2"),
        ("--grad-filter-threshold", "1.1", "--grad-filter-mode", "uniform"),
    ],
    ids=["soft", "hard-mask+ctc", "uniform"],
)
def test_a_padded_batch_gives_the_batch_losses_and_gradients(tiny_data, flags):
    params, model, sp = _model(str(tiny_data / "data/lang_bpe_100/bpe.model"), *flags)
    inputs = _inputs(sp)
    assert inputs.shape[:2] == (4, 110)
    shape = static_shape(*inputs.shape)
    assert shape == (4, 128, 32)
    plain = _step(params, model, inputs)
    for padded_shape in (shape, (7, 300, 40)):  # 3 dummy rows, 190 extra frames, 28 or more token positions
        padded = pad_to(inputs, padded_shape)
        assert padded.shape == padded_shape
        assert _largest_difference(_step(params, model, padded), plain) < 1e-6  # (rounding: 5e-14 seen)
    for module in model.modules():
        if getattr(module, "grad_filter", None) is not None:
            assert module.grad_filter.stats.num_backward == 3
    assert float(model.encoder.encoder.layers[0].lstm.grad_filter.stats.fraction_filtered) > 0  # a row above the cutoff


def test_the_check_would_see_statistics_over_the_padding(tiny_data, monkeypatch):
    """The same comparison with the statistics counting every frame and row of the padded batch (icefall's
    balancers and filter, given the padded batch) fails: the test above can fail."""
    params, model, sp = _model(str(tiny_data / "data/lang_bpe_100/bpe.model"), "--grad-filter-threshold", "1.1")
    inputs = _inputs(sp)
    plain = _step(params, model, inputs)
    monkeypatch.setattr(encoder_module, "real_extent", lambda x_lens, real: torch.full_like(x_lens, 1 << 30))
    padded = _step(params, model, pad_to(inputs, static_shape(*inputs.shape)))
    assert _relative(padded[1][LSTM_0], plain[1][LSTM_0]) > 1e-3


def test_static_shapes():
    assert static_shape(1, 1, 0) == (1, 128, 32)
    assert static_shape(5, 128, 32) == (8, 128, 32)
    assert static_shape(8, 129, 33) == (8, 256, 64)
    assert static_shape(33, 1000, 70) == (64, 1024, 96)
    inputs = BatchTensors(
        torch.zeros(2, 3, 4),
        torch.tensor([3, 2]),
        torch.ones(2, 1, dtype=torch.int64),
        torch.tensor([1, 1]),
        torch.ones(2, dtype=torch.bool),
    )
    padded = pad_to(inputs, (4, 5, 2))
    assert padded.feature_lens.tolist() == [3, 2, 5, 5]
    assert padded.token_lens.tolist() == [1, 1, 0, 0]
    assert padded.real.tolist() == [True, True, False, False]
    assert padded.tokens.tolist() == [[1, 0], [1, 0], [0, 0], [0, 0]]
    assert torch.equal(padded.features[:2, :3], inputs.features)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_to(inputs, (1, 5, 2))
