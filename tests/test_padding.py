"""What padding does to a training step: what a CUDA graph per bucket needs (every batch padded to its bucket's
shape) and what eager training already does (each batch padded to its longest utterance).

Extra frames after every utterance leave the loss as it was and, but for the ActivationBalancers, the gradients
(to rounding); the balancers take their statistics over all frames, padding too (as icefall's do), so padding
moves the first layers' gradients."""

import pytest
import torch

from conftest import tiny_training_setup
from icefall_lite.nn.scaling import ActivationBalancer
from icefall_lite.train.loss import compute_loss

LSTM_0 = "encoder.encoder.layers.0.lstm.weight_ih_l0"


def _batch(extra_frames: int) -> dict:
    """Four utterances of 110, 100, 90 and 75 frames padded as lhotse pads (log 1e-10), plus ``extra_frames``."""
    gen = torch.Generator().manual_seed(5)
    lengths = [110, 100, 90, 75]
    x = torch.full((4, 110 + extra_frames, 80), -23.0)
    for i, n in enumerate(lengths):
        x[i, :n] = torch.randn(n, 80, generator=gen)
    texts = ["HELLO THERE", "A CAT", "THE END", "THERE IS A CAT"]
    return {"inputs": x, "supervisions": {"text": texts, "num_frames": torch.tensor(lengths)}}


def _step(bpe_model: str, batch: dict):
    """The loss and every parameter's gradient of one training forward and backward (the filter observing)."""
    params, model, sp = tiny_training_setup(bpe_model, "--grad-filter-threshold", "inf")
    loss, _ = compute_loss(params, model, sp, batch, is_training=True)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_padding_changes_the_gradients_only_through_the_activation_balancers(tiny_data, monkeypatch):
    bpe_model = str(tiny_data / "data/lang_bpe_100/bpe.model")
    loss, grads = _step(bpe_model, _batch(0))
    padded_loss, padded = _step(bpe_model, _batch(48))
    assert padded_loss == pytest.approx(loss, rel=1e-6)
    assert _relative(padded[LSTM_0], grads[LSTM_0]) > 1e-3  # the balancers saw 48 more frames (1.2% here)
    monkeypatch.setattr(ActivationBalancer, "forward", lambda self, x: x)
    loss, grads = _step(bpe_model, _batch(0))
    padded_loss, padded = _step(bpe_model, _batch(48))
    assert padded_loss == pytest.approx(loss, rel=1e-6)
    assert max(_relative(padded[n], g) for n, g in grads.items()) < 1e-5  # rounding (1e-6 seen)
