"""The public RNN-T losses on float16/bfloat16 scores: computed in float32, so the loss and the gradients
equal those of the same (rounded) values given in float32; without the upcast float16 posteriors are flushed
to zero (every gradient 0.0) and scores overflow past 65504."""

import pytest
import torch

from icefall_lite.nn.rnnt_loss import (
    get_rnnt_prune_ranges,
    make_boundary,
    mutual_information_recursion,
    rnnt_loss,
    rnnt_loss_pruned,
    rnnt_loss_simple,
    rnnt_loss_smoothed,
    rnnt_loss_torchaudio,
)

B, T, S, C = 2, 30, 6, 9


def _inputs(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    lm = (torch.randn(B, S + 1, C, generator=gen) * 2).to(dtype)
    am = (torch.randn(B, T, C, generator=gen) * 2).to(dtype)
    logits = (torch.randn(B, T, S + 1, C, generator=gen) * 2).to(dtype)
    symbols = torch.randint(1, C, (B, S), generator=gen)
    boundary = make_boundary(torch.tensor([S, S - 2]), torch.tensor([T, T - 7]))
    return lm, am, logits, symbols, boundary


def _loss_and_grads(fn, tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    loss = fn(*leaves)
    loss.backward()
    return loss, [leaf.grad for leaf in leaves]


def _pruned(logits, lm, am, symbols, boundary):
    """The pruned loss on windows of 3 symbols chosen from the float32 simple loss; ``logits`` (B, T, S+1, C)
    cut to 3 columns stand for the joiner's output on the windows."""
    _, (px_grad, py_grad) = rnnt_loss_simple(
        lm.detach().float(), am.detach().float(), symbols, 0, boundary, return_grad=True
    )
    ranges = get_rnnt_prune_ranges(px_grad, py_grad, boundary, s_range=3)
    return rnnt_loss_pruned(logits[:, :, :3], symbols, ranges, 0, boundary)


LOSSES = {
    "rnnt_loss_simple": lambda lm, am, logits, symbols, boundary: rnnt_loss_simple(lm, am, symbols, 0, boundary),
    "rnnt_loss_smoothed": lambda lm, am, logits, symbols, boundary: rnnt_loss_smoothed(
        lm, am, symbols, 0, 0.1, 0.1, boundary
    ),
    "rnnt_loss": lambda lm, am, logits, symbols, boundary: rnnt_loss(logits, symbols, 0, boundary),
    "rnnt_loss_torchaudio": lambda lm, am, logits, symbols, boundary: rnnt_loss_torchaudio(
        logits, symbols, boundary[:, 3], boundary[:, 2]
    ),
    "rnnt_loss_pruned": lambda lm, am, logits, symbols, boundary: _pruned(logits, lm, am, symbols, boundary),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_half_inputs_give_the_float32_loss_and_gradients(name: str, dtype: torch.dtype) -> None:
    lm, am, logits, symbols, boundary = _inputs(dtype)

    def fn(lm_, am_, logits_):
        return LOSSES[name](lm_, am_, logits_, symbols, boundary)

    half_loss, half_grads = _loss_and_grads(fn, [lm, am, logits])
    ref_loss, ref_grads = _loss_and_grads(fn, [lm.float(), am.float(), logits.float()])
    assert half_loss.dtype == torch.float32
    torch.testing.assert_close(half_loss, ref_loss, rtol=1e-6, atol=1e-5)
    used = [g for g in ref_grads if g is not None and g.abs().sum() > 0]
    assert used, name
    for half_grad, ref_grad in zip(half_grads, ref_grads):
        if ref_grad is None:
            continue
        assert half_grad.dtype == dtype
        # The float32 gradient rounded once to the input's dtype.
        torch.testing.assert_close(half_grad, ref_grad.to(dtype), rtol=0, atol=0)


def test_float16_recursion_posteriors_are_not_flushed() -> None:
    gen = torch.Generator().manual_seed(1)
    px = torch.randn(B, S, T + 1, generator=gen).log_softmax(-1)
    px[:, :, T] = float("-inf")
    py = torch.randn(B, S + 1, T, generator=gen).log_softmax(-1)
    scores, (px_grad, py_grad) = mutual_information_recursion(px.half(), py.half(), return_grad=True)
    ref_scores, (ref_px_grad, ref_py_grad) = mutual_information_recursion(
        px.half().float(), py.half().float(), return_grad=True
    )
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=0)
    # Each sequence's frame-arc posteriors sum to its number of frames (every path takes T blank arcs).
    torch.testing.assert_close(py_grad.sum(dim=(1, 2)), torch.full((B,), float(T)), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(px_grad, ref_px_grad, rtol=0, atol=0)


def test_loss_under_cpu_autocast_equals_float32() -> None:
    lm, am, logits, symbols, boundary = _inputs(torch.float32)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        under = rnnt_loss_simple(lm, am, symbols, 0, boundary, reduction="none")
    ref = rnnt_loss_simple(lm, am, symbols, 0, boundary, reduction="none")
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, ref, rtol=0, atol=0)
