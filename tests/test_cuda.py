"""On a CUDA GPU: a few training steps of train.py and a decode with every method, and the loss and
searches on CUDA against the CPU. Without a GPU these tests are reported as skipped with the reason
"no CUDA GPU": they were not run (CI and the 2-core development machines have none). The wider GPU
check (mixed precision, resume, streaming, synchronisations) is ``make gpu-check``."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import RECIPE_SCRIPTS, recipe_env, tiny_transducer
from icefall_lite.decoding.constants import DECODING_METHODS
from icefall_lite.decoding.fast_beam_search import fast_beam_search_one_best
from icefall_lite.decoding.greedy_search import greedy_search_batch
from icefall_lite.decoding.modified_beam_search import modified_beam_search
from icefall_lite.nn.mutual_information import make_boundary, mutual_information_recursion
from icefall_lite.train.checkpoint import load_checkpoint_file

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the CUDA tests were not run"
)

# LSTM hidden 64 > encoder dim 32: an LSTM with a projection, the icefall preset's cuDNN path.
TINY_MODEL = [
    "--encoder-dim",
    "32",
    "--rnn-hidden-size",
    "64",
    "--dim-feedforward",
    "64",
    "--num-encoder-layers",
    "2",
    "--decoder-dim",
    "32",
    "--joiner-dim",
    "32",
]
COMMON = ["--bpe-model", "data/lang_bpe_100/bpe.model", "--max-duration", "30", "--num-workers", "0", *TINY_MODEL]


def test_train_steps_and_decode_on_cuda(tiny_data: Path, tmp_path: Path) -> None:
    exp_dir = tmp_path / "exp"
    train = subprocess.run(
        [
            sys.executable,
            str(RECIPE_SCRIPTS / "train.py"),
            "--exp-dir",
            str(exp_dir),
            "--num-epochs",
            "1",
            "--max-batches",
            "4",
            "--log-interval",
            "1",
            "--tensorboard",
            "false",
            *COMMON,
        ],
        cwd=tiny_data,
        capture_output=True,
        text=True,
        env=recipe_env(),
        timeout=600,
    )
    assert train.returncode == 0, train.stderr
    assert "Device: cuda:0" in train.stderr
    # --max-batches 4 stops with checkpoint-4.pt (no epoch-1.pt): decode that one with --iter.
    checkpoint = load_checkpoint_file(exp_dir / "checkpoint-4.pt")
    assert checkpoint["batch_idx_train"] == 4
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values() if v.is_floating_point())
    for method in DECODING_METHODS:
        decode = subprocess.run(
            [
                sys.executable,
                str(RECIPE_SCRIPTS / "decode.py"),
                "--exp-dir",
                str(exp_dir),
                "--iter",
                "4",
                "--avg",
                "1",
                "--use-averaged-model",
                "false",
                "--decoding-method",
                method,
                *COMMON,
            ],
            cwd=tiny_data,
            capture_output=True,
            text=True,
            env=recipe_env(),
            timeout=600,
        )
        assert decode.returncode == 0, decode.stderr
        assert list((exp_dir / method).glob("wer-summary-test-clean-*.txt")), method


def test_recursion_on_cuda_equals_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    px = torch.randn(4, 7, 31, generator=gen, dtype=torch.float64).log_softmax(-1)
    py = torch.randn(4, 8, 30, generator=gen, dtype=torch.float64).log_softmax(-1)
    px[:, :, 30] = float("-inf")
    boundary = make_boundary(torch.tensor([7, 3, 5, 0]), torch.tensor([30, 12, 30, 4]))
    cpu_scores, (cpu_gx, cpu_gy) = mutual_information_recursion(px, py, boundary, return_grad=True)
    scores, (gx, gy) = mutual_information_recursion(px.cuda(), py.cuda(), boundary.cuda(), return_grad=True)
    torch.testing.assert_close(scores.cpu(), cpu_scores, rtol=0, atol=1e-10)
    torch.testing.assert_close(gx.cpu(), cpu_gx, rtol=0, atol=1e-10)
    torch.testing.assert_close(gy.cpu(), cpu_gy, rtol=0, atol=1e-10)


def test_searches_on_cuda_equal_cpu() -> None:
    torch.manual_seed(0)
    model = tiny_transducer(
        vocab_size=30,
        encoder_dim=32,
        rnn_hidden_size=32,
        dim_feedforward=64,
        num_encoder_layers=2,
        decoder_dim=32,
        joiner_dim=32,
    ).eval()
    encoder_out = torch.randn(3, 20, 32) * 3
    lens = torch.tensor([20, 11, 16])
    searches = {
        "greedy": lambda m, e, n: greedy_search_batch(m, e, n),
        "modified": lambda m, e, n: modified_beam_search(m, e, n, beam=4),
        "fast": lambda m, e, n: fast_beam_search_one_best(m, e, n, beam=8.0, max_states=16, max_contexts=4),
    }
    for name, search in searches.items():
        cpu = search(model, encoder_out, lens)
        cuda = search(model.cuda(), encoder_out.cuda(), lens.cuda())
        model.cpu()
        assert cuda == cpu, name
