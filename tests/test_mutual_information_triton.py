"""The Triton mutual-information kernel (icefall_lite/nn/mutual_information_triton.py) against the PyTorch
recursion it replaces on the GPU: scores and arc posteriors within 1e-6 relative on random lattices, regular and
modified, including S = 0, T = 1, S > T, ragged boundaries, -inf arcs and broken sequences; every loss through
the kernel (values and gradients) equal to the same loss through the PyTorch recursion; and the dispatch
between the two (mutual_information.BACKEND). On the CPU in Triton's interpreter (conftest sets
TRITON_INTERPRET), on CUDA where there is a GPU."""

import math
from unittest import mock

import pytest
import torch

from icefall_lite.nn import mutual_information
from icefall_lite.nn.rnnt_loss import (
    do_rnnt_pruning,
    get_rnnt_prune_ranges,
    make_boundary,
    mutual_information_recursion,
    rnnt_loss,
    rnnt_loss_pruned,
    rnnt_loss_simple,
    rnnt_loss_smoothed,
    rnnt_loss_torchaudio,
)

pytest.importorskip("triton", reason="Triton has wheels for Linux only (there: pip install triton)")
from icefall_lite.nn.mutual_information_triton import mutual_information_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on(backend: str):
    """Run the recursion by ``backend`` ("triton" or "pytorch") inside the block."""
    return mock.patch.object(mutual_information, "BACKEND", backend)


def _lattice(B: int, S: int, T: int, modified: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    px = torch.randn(B, S, T if modified else T + 1, generator=gen, dtype=dtype)
    py = torch.randn(B, S + 1, T, generator=gen, dtype=dtype)
    if not modified:
        px[:, :, T] = -math.inf  # as an RNN-T's px: no symbol after the last frame
    return px.to(DEVICE), py.to(DEVICE)


def _ragged(B: int, S: int, T: int, seed: int) -> torch.Tensor:
    """Random boxes ``0 <= s_begin <= s_end <= S``, ``0 <= t_begin <= t_end <= T``."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.sort(torch.randint(0, S + 1, (B, 2), generator=gen), dim=1).values
    t = torch.sort(torch.randint(0, T + 1, (B, 2), generator=gen), dim=1).values
    return torch.stack([s[:, 0], t[:, 0], s[:, 1], t[:, 1]], dim=1).to(DEVICE)


def _both(*args, **kwargs):
    """``mutual_information_recursion(*args, **kwargs)`` by the kernel, then by the PyTorch recursion."""
    with on("triton"):
        got = mutual_information_recursion(*args, **kwargs)
    with on("pytorch"):
        want = mutual_information_recursion(*args, **kwargs)
    return got, want


def _assert_equal(got, want) -> None:
    scores, (px_grad, py_grad) = got
    ref_scores, (ref_px, ref_py) = want
    torch.testing.assert_close(scores, ref_scores, rtol=1e-6, atol=1e-9, equal_nan=True)
    torch.testing.assert_close(px_grad, ref_px, rtol=1e-6, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(py_grad, ref_py, rtol=1e-6, atol=1e-12, equal_nan=True)


CASES = [(3, 4, 6), (2, 0, 5), (2, 3, 1), (2, 9, 4), (1, 0, 1), (4, 17, 23)]


@pytest.mark.parametrize("modified", [False, True], ids=["regular", "modified"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("shape", CASES, ids=[f"B{b}-S{s}-T{t}" for b, s, t in CASES])
def test_scores_and_posteriors_equal_the_pytorch_recursion(shape, dtype, modified):
    B, S, T = shape
    px, py = _lattice(B, S, T, modified, dtype, seed=S * 100 + T)
    for boundary in (None, _ragged(B, S, T, seed=T)):
        got, want = _both(px, py, boundary, return_grad=True)
        assert got[0].dtype == dtype and got[1][0].shape == px.shape and got[1][1].shape == py.shape
        _assert_equal(got, want)


@pytest.mark.parametrize("modified", [False, True], ids=["regular", "modified"])
def test_scores_alone_equal_the_pytorch_recursion(modified):
    # without gradients only the forward programs run (a grid of one column)
    px, py = _lattice(3, 4, 6, modified, torch.float32, seed=5)
    boundary = _ragged(3, 4, 6, seed=5)
    got, want = _both(px, py, boundary)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_a_hand_worked_lattice():
    # Regular, S = 1, T = 1, zero arcs but px[0, 1] = -inf. Of the two paths from (0, 0) to (1, 1), the one
    # through (0, 1) ends on px[0, 1] = -inf; the other, px[0, 0] then py[1, 0], scores 0 and carries it all.
    px = torch.tensor([[[0.0, -math.inf]]], device=DEVICE)
    py = torch.tensor([[[0.0], [0.0]]], device=DEVICE)
    boundary = torch.tensor([[0, 0, 1, 1]], device=DEVICE)
    scores, px_grad, py_grad = mutual_information_kernel(px, py, boundary, True)
    assert scores.tolist() == [0.0]
    assert px_grad.tolist() == [[[1.0, 0.0]]] and py_grad.tolist() == [[[0.0], [1.0]]]
    # Modified, S = 1, T = 1: the one path is px[0, 0], (0, 0) -> (1, 1); py[1, 0] leaves (1, 0), which no
    # path reaches (a symbol also takes a frame), and py[0, 0] ends at (0, 1), not at the end.
    px = torch.tensor([[[1.5]]], device=DEVICE)
    py = torch.tensor([[[0.3], [0.7]]], device=DEVICE)
    scores, px_grad, py_grad = mutual_information_kernel(px, py, boundary, True)
    assert scores.tolist() == [1.5] and px_grad.tolist() == [[[1.0]]] and py_grad.tolist() == [[[0.0], [0.0]]]
    assert mutual_information_kernel(px, py, boundary, False)[1:] == (None, None)


def test_broken_and_impossible_sequences_as_the_pytorch_recursion_has_them():
    px, py = _lattice(4, 5, 7, False, torch.float32, seed=1)
    px[1, 2, 3] = math.nan  # broken: NaN score and posteriors, the others untouched
    py[2, 0, 0] = math.inf  # broken too
    py[3, :, :] = -math.inf  # no path: score -inf, zero posteriors
    px[3, :, :] = -math.inf
    got, want = _both(px, py, return_grad=True)
    _assert_equal(got, want)
    assert math.isnan(got[0][1]) and math.isnan(got[0][2]) and got[0][3] == -math.inf and math.isfinite(got[0][0])


def test_autograd_gives_grad_score_times_the_posteriors():
    px, py = _lattice(3, 6, 8, True, torch.float32, seed=2)
    weights = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    grads = []
    for backend in ("triton", "pytorch"):
        x, y = px.clone().requires_grad_(True), py.clone().requires_grad_(True)
        with on(backend):
            (mutual_information_recursion(x, y) * weights).sum().backward()
        grads.append((x.grad, y.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)


def test_a_bad_boundary_is_refused():
    px, py = _lattice(2, 3, 4, False, torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"boundary must be \(B, 4\)"):
        mutual_information_kernel(px, py, torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), True)
    if DEVICE.type == "cuda":
        return  # there a bad row is a device-side assert, which ends the process's use of CUDA (documented)
    bad = torch.tensor([[0, 0, 4, 4], [0, 0, 3, 4]])  # s_end 4 > S 3
    with pytest.raises(RuntimeError, match="s_begin <= s_end <= S"):
        mutual_information_kernel(px, py, bad, True)


# --------------------------------------------------------------------------
# the losses through the kernel
# --------------------------------------------------------------------------

B, T, S, V = 3, 6, 4, 5
FRAMES, SYMBOLS = torch.tensor([6, 4, 5]), torch.tensor([4, 2, 0])


def _inputs(seed: int):
    """Leaves ``lm (B, S+1, V)``, ``am (B, T, V)``, ``logits (B, T, S+1, V)``, symbols, boundary."""
    gen = torch.Generator().manual_seed(seed)
    lm = torch.randn(B, S + 1, V, generator=gen)
    am = torch.randn(B, T, V, generator=gen)
    logits = torch.randn(B, T, S + 1, V, generator=gen)
    symbols = torch.randint(1, V, (B, S), generator=gen)
    boundary = make_boundary(SYMBOLS, FRAMES)
    return [x.to(DEVICE) for x in (lm, am, logits, symbols, boundary)]


def _loss_and_grads(backend: str, loss_fn, seed: int):
    """``loss_fn(lm, am, logits, symbols, boundary)`` (per-sequence losses) by ``backend``, and the gradients
    of their weighted sum w.r.t. lm, am and logits (zero where unused)."""
    lm, am, logits, symbols, boundary = _inputs(seed)
    leaves = [x.requires_grad_(True) for x in (lm, am, logits)]
    with on(backend):
        losses = loss_fn(*leaves, symbols, boundary)
    weights = torch.tensor([0.5, 1.0, 2.0], device=DEVICE)
    grads = torch.autograd.grad((losses * weights).sum(), leaves, allow_unused=True)
    return losses.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def _training_loss(lm, am, logits, symbols, boundary, rnnt_type):
    """The recipe's loss: smoothed simple loss, windows from its posteriors, pruned loss on a tanh joiner."""
    simple, (px_grad, py_grad) = rnnt_loss_smoothed(
        lm, am, symbols, 0, 0.25, 0.0, boundary, rnnt_type=rnnt_type, reduction="none", return_grad=True
    )
    ranges = get_rnnt_prune_ranges(px_grad, py_grad, boundary, s_range=2)
    pruned_am, pruned_lm = do_rnnt_pruning(am, lm, ranges)
    pruned_logits = torch.tanh(pruned_am + pruned_lm)
    pruned = rnnt_loss_pruned(pruned_logits, symbols, ranges, 0, boundary, rnnt_type=rnnt_type, reduction="none")
    return 0.5 * simple + pruned


LOSSES = {
    "rnnt_loss": lambda lm, am, logits, sym, bnd, kind: rnnt_loss(logits, sym, 0, bnd, kind, reduction="none"),
    "rnnt_loss_simple": lambda lm, am, logits, sym, bnd, kind: rnnt_loss_simple(
        lm, am, sym, 0, bnd, kind, delay_penalty=0.1, reduction="none"
    ),
    "smoothed+pruned": _training_loss,
}


@pytest.mark.parametrize("rnnt_type", ["regular", "modified", "constrained"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_through_the_kernel_equals_the_pytorch_path(name, rnnt_type):
    loss_fn = lambda *a: LOSSES[name](*a, rnnt_type)  # noqa: E731
    got, got_grads = _loss_and_grads("triton", loss_fn, seed=len(name))
    want, want_grads = _loss_and_grads("pytorch", loss_fn, seed=len(name))
    assert torch.isfinite(want).all() and any(g.abs().sum() > 0 for g in want_grads)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_the_torchaudio_order_loss_through_the_kernel_equals_the_pytorch_path():
    targets = torch.full((B, S), -1)  # padding past each length, as torchaudio's callers leave it
    for b, n in enumerate(SYMBOLS.tolist()):
        targets[b, :n] = torch.arange(1, n + 1)

    def loss_fn(lm, am, logits, symbols, boundary):
        return rnnt_loss_torchaudio(logits, targets.to(DEVICE), FRAMES.to(DEVICE), SYMBOLS.to(DEVICE), reduction="none")

    got, got_grads = _loss_and_grads("triton", loss_fn, seed=7)
    want, want_grads = _loss_and_grads("pytorch", loss_fn, seed=7)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grads[2], want_grads[2], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------
# the dispatch
# --------------------------------------------------------------------------


def test_auto_takes_the_kernel_for_cuda_tensors_only_and_either_can_be_forced():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects only: no GPU needed
    pytorch_path = mutual_information._mutual_information
    assert mutual_information.BACKEND == "auto"
    assert mutual_information._implementation(cpu) is pytorch_path
    assert mutual_information._implementation(cuda) is mutual_information_kernel
    with on("pytorch"):
        assert mutual_information._implementation(cuda) is pytorch_path
    with on("triton"):
        assert mutual_information._implementation(cpu) is mutual_information_kernel
    with on("Triton"), pytest.raises(ValueError, match="BACKEND must be one of"):
        mutual_information_recursion(*_lattice(1, 2, 3, False, torch.float32, seed=4))


def test_without_triton_auto_takes_the_pytorch_recursion_and_triton_is_refused():
    with mock.patch.object(mutual_information, "_triton_kernel", lambda: None):
        assert mutual_information._implementation(torch.device("cuda")) is mutual_information._mutual_information
        with on("triton"), pytest.raises(RuntimeError, match="Triton is not installed"):
            mutual_information._implementation(torch.device("cpu"))
