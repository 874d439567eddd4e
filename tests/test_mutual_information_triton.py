"""The Triton mutual-information kernel (icefall_lite/nn/mutual_information_triton.py) against the PyTorch
recursion it replaces on the GPU: scores and arc posteriors within 1e-6 relative on random lattices, regular and
modified, including S = 0, T = 1, S > T, ragged boundaries, -inf arcs and broken sequences; on the CPU in
Triton's interpreter (conftest sets TRITON_INTERPRET), on CUDA where there is a GPU."""

import math

import pytest
import torch

from icefall_lite.nn.mutual_information import mutual_information_recursion

pytest.importorskip("triton", reason="Triton has wheels for Linux only (there: pip install triton)")
from icefall_lite.nn import mutual_information_triton as triton_mi  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
        got = triton_mi.mutual_information_recursion_triton(px, py, boundary, return_grad=True)
        want = mutual_information_recursion(px, py, boundary, return_grad=True)
        assert got[0].dtype == dtype and got[1][0].shape == px.shape and got[1][1].shape == py.shape
        _assert_equal(got, want)


def test_a_hand_worked_lattice():
    # Regular, S = 1, T = 1, zero arcs but px[0, 1] = -inf. Of the two paths from (0, 0) to (1, 1), the one
    # through (0, 1) ends on px[0, 1] = -inf; the other, px[0, 0] then py[1, 0], scores 0 and carries it all.
    px = torch.tensor([[[0.0, -math.inf]]], device=DEVICE)
    py = torch.tensor([[[0.0], [0.0]]], device=DEVICE)
    scores, (px_grad, py_grad) = triton_mi.mutual_information_recursion_triton(px, py, return_grad=True)
    assert scores.tolist() == [0.0]
    assert px_grad.tolist() == [[[1.0, 0.0]]] and py_grad.tolist() == [[[0.0], [1.0]]]
    # Modified, S = 1, T = 1: the one path is px[0, 0], (0, 0) -> (1, 1); py[1, 0] leaves (1, 0), which no
    # path reaches (a symbol also takes a frame), and py[0, 0] ends at (0, 1), not at the end.
    px = torch.tensor([[[1.5]]], device=DEVICE)
    py = torch.tensor([[[0.3], [0.7]]], device=DEVICE)
    scores, (px_grad, py_grad) = triton_mi.mutual_information_recursion_triton(px, py, return_grad=True)
    assert scores.tolist() == [1.5] and px_grad.tolist() == [[[1.0]]] and py_grad.tolist() == [[[0.0], [0.0]]]


def test_broken_and_impossible_sequences_as_the_pytorch_recursion_has_them():
    px, py = _lattice(4, 5, 7, False, torch.float32, seed=1)
    px[1, 2, 3] = math.nan  # broken: NaN score and posteriors, the others untouched
    py[2, 0, 0] = math.inf  # broken too
    py[3, :, :] = -math.inf  # no path: score -inf, zero posteriors
    px[3, :, :] = -math.inf
    got = triton_mi.mutual_information_recursion_triton(px, py, return_grad=True)
    want = mutual_information_recursion(px, py, return_grad=True)
    _assert_equal(got, want)
    assert math.isnan(got[0][1]) and math.isnan(got[0][2]) and got[0][3] == -math.inf and math.isfinite(got[0][0])


def test_autograd_gives_grad_score_times_the_posteriors():
    px, py = _lattice(3, 6, 8, True, torch.float32, seed=2)
    px.requires_grad_(True)
    py.requires_grad_(True)
    weights = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    (triton_mi.mutual_information_recursion_triton(px, py) * weights).sum().backward()
    ref_px, ref_py = px.detach().clone().requires_grad_(True), py.detach().clone().requires_grad_(True)
    (mutual_information_recursion(ref_px, ref_py) * weights).sum().backward()
    torch.testing.assert_close(px.grad, ref_px.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(py.grad, ref_py.grad, rtol=1e-6, atol=1e-12)


def test_a_bad_boundary_is_refused():
    px, py = _lattice(2, 3, 4, False, torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"boundary must be \(B, 4\)"):
        triton_mi.mutual_information_recursion_triton(px, py, torch.zeros(2, 3, dtype=torch.int64))
    if DEVICE.type == "cuda":
        return  # there a bad row is a device-side assert, which ends the process's use of CUDA (documented)
    bad = torch.tensor([[0, 0, 4, 4], [0, 0, 3, 4]])  # s_end 4 > S 3
    with pytest.raises(RuntimeError, match="s_begin <= s_end <= S"):
        triton_mi.mutual_information_recursion_triton(px, py, bad)
