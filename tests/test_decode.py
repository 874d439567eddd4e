"""decode.py: icefall's flags, suffixes and result files on the tiny corpus,
tail padding, and clear errors (checkpoint selection itself: test_checkpoint.py)."""

from __future__ import annotations

import copy
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Sequence

import numpy as np
import pytest
import torch
import torch.nn as nn
from lhotse import CutSet, load_manifest

from conftest import RECIPE, assert_flag_error, check_wer_files, recipe_env, tiny_transducer, with_features
from icefall_lite.decoding.cli import get_params, get_parser, validate_args
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.decode_run import resolve_test_sets, result_key, validate_test_sets
from icefall_lite.decoding.greedy_search import greedy_search, greedy_search_batch
from icefall_lite.decoding.offline import decode_one_batch, search_tokens
from icefall_lite.recipe_defaults import AVG, EXP_DIR, NUM_EPOCHS
from icefall_lite.train.checkpoint import save_checkpoint
from icefall_lite.utils import AttributeDict

DECODE = RECIPE / "lstm_transducer_stateless" / "decode.py"
TINY_SIZES = dict(
    encoder_dim=32, rnn_hidden_size=32, dim_feedforward=64, num_encoder_layers=2, decoder_dim=32, joiner_dim=32
)
TINY_FLAGS = [item for k, v in TINY_SIZES.items() for item in (f"--{k.replace('_', '-')}", str(v))]
BPE = "data/lang_bpe_100/bpe.model"
VOCAB_SIZE = 100  # prepare.sh --size tiny trains a 100-piece BPE model
SUFFIXES = {
    "greedy_search": "epoch-3-avg-2-context-2-max-sym-per-frame-1-use-averaged-model",
    "modified_beam_search": "epoch-3-avg-2-modified_beam_search-beam-size-4-use-averaged-model",
    "fast_beam_search": "epoch-3-avg-2-beam-20.0-max-contexts-8-max-states-64-use-averaged-model",
}
KEYS = {
    "greedy_search": "greedy_search",
    "modified_beam_search": "beam_size_4",
    "fast_beam_search": "beam_20.0_max_contexts_8_max_states_64",
}
EXTRA_SET = "my_cuts"  # a test set given by manifest path (a copy of test-clean)
DECODED_SETS = (*TEST_SETS, EXTRA_SET)


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def tiny_model(vocab_size: int = VOCAB_SIZE, seed: int = 0, **overrides: int) -> nn.Module:
    torch.manual_seed(seed)
    return tiny_transducer(vocab_size=vocab_size, **{**TINY_SIZES, **overrides})


def running_average(models: Sequence[nn.Module]) -> nn.Module:
    """float64 model whose floating entries are the mean of ``models`` (train.py's model_avg)."""
    avg = copy.deepcopy(models[0]).to(torch.float64)
    states = [m.state_dict() for m in models]
    for name, value in avg.state_dict().items():
        if value.dtype.is_floating_point:
            value.copy_(sum(s[name].double() for s in states) / len(states))
    return avg


def lean_to_blank(model: nn.Module, nats: float = 1.0) -> nn.Module:
    """Make blank likelier by ``nats`` on every frame, as in trained models: with a random model's rare
    blank, k2's fast beam search keeps no final state on the last frame and answers nothing."""
    linear = model.joiner.output_linear
    with torch.no_grad():
        linear.bias[model.decoder.blank_id] += nats / linear.bias_scale.exp()
    return model


def write_epoch_checkpoints(exp_dir: Path, num_epochs: int, **sizes: int) -> None:
    """epoch-1.pt .. epoch-N.pt of random tiny models leaning to blank; model_avg = mean so far, 10
    batches per epoch."""
    models = []
    for epoch in range(1, num_epochs + 1):
        models.append(lean_to_blank(tiny_model(seed=epoch, **sizes)))
        save_checkpoint(
            exp_dir / f"epoch-{epoch}.pt",
            models[-1],
            model_avg=running_average(models),
            params={"batch_idx_train": 10 * epoch},
        )


def run_decode(work: Path, *args: str) -> subprocess.CompletedProcess:
    """decode.py as a user runs it; one OpenMP thread (tiny matrices, shared 2-core machines)."""
    env = recipe_env()
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(DECODE), "--bpe-model", BPE, "--num-workers", "0", *TINY_FLAGS, *args]
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices gain nothing from threads; on a shared 2-core machine spinning
    OpenMP workers make the in-process decodes many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------
# Flags, suffixes, keys
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, suffix, key",
    [
        ([], "epoch-5-avg-2-context-2-max-sym-per-frame-1-use-averaged-model", "greedy_search"),
        (
            ["--decoding-method", "modified_beam_search"],
            "epoch-5-avg-2-modified_beam_search-beam-size-4-use-averaged-model",
            "beam_size_4",
        ),
        (
            ["--decoding-method", "fast_beam_search"],
            "epoch-5-avg-2-beam-20.0-max-contexts-8-max-states-64-use-averaged-model",
            "beam_20.0_max_contexts_8_max_states_64",
        ),
        (
            ["--iter", "1000", "--avg", "2", "--use-averaged-model", "false", "--max-sym-per-frame", "3"],
            "iter-1000-avg-2-context-2-max-sym-per-frame-3",
            "greedy_search",
        ),
        (
            ["--blank-penalty", "1.5"],
            "epoch-5-avg-2-context-2-max-sym-per-frame-1-use-averaged-model-blank-penalty-1.5",
            "greedy_search",
        ),
        (
            [
                "--epoch",
                "30",
                "--avg",
                "15",
                "--decoding-method",
                "fast_beam_search",
                "--beam",
                "4",
                "--max-contexts",
                "4",
                "--max-states",
                "8",
            ],
            "epoch-30-avg-15-beam-4.0-max-contexts-4-max-states-8-use-averaged-model",
            "beam_4.0_max_contexts_4_max_states_8",
        ),
    ],
)
def test_suffix_and_key_follow_icefall(argv, suffix, key):
    params = get_params(get_parser().parse_args(argv))
    assert params.suffix == suffix
    assert result_key(params) == key
    assert params.res_dir == Path("lstm_transducer_stateless/exp") / params.decoding_method


def test_defaults():
    args = get_parser().parse_args([])
    # train.py's defaults (one home: icefall_lite/recipe_defaults.py)
    assert (args.epoch, args.iter, args.avg, args.use_averaged_model) == (NUM_EPOCHS, 0, AVG, True)
    assert args.exp_dir == EXP_DIR
    assert (args.beam_size, args.beam, args.max_contexts, args.max_states, args.max_sym_per_frame) == (
        4,
        20.0,
        8,
        64,
        1,
    )
    assert args.test_sets is None  # resolved by validate_test_sets (next test)
    assert args.decoding_method == "greedy_search"


def test_default_test_sets_follow_mini_libri(tiny_data, tmp_path):
    """Without --test-sets: test-clean and test-other; with --mini-libri true, mini LibriSpeech's dev-clean-2."""
    fbank = tiny_data / "data/fbank"
    parser = get_parser()
    args = parser.parse_args(["--manifest-dir", str(fbank)])
    validate_test_sets(parser, args)
    assert [name for name, _ in args.test_set_paths] == ["test-clean", "test-other"]
    mini = tmp_path / "fbank"
    mini.mkdir()
    shutil.copy(fbank / "librispeech_cuts_dev-clean.jsonl.gz", mini / "librispeech_cuts_dev-clean-2.jsonl.gz")
    args = parser.parse_args(["--manifest-dir", str(mini), "--mini-libri", "true"])
    validate_test_sets(parser, args)
    assert args.test_set_paths == [("dev-clean-2", mini / "librispeech_cuts_dev-clean-2.jsonl.gz")]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--avg", "0"], "--avg must be positive, got 0"),
        (["--epoch", "0"], "--epoch must be positive, got 0"),
        (["--iter", "-1"], "--iter must be >= 0"),
        (["--beam-size", "0"], "--beam-size must be positive"),
        (["--beam", "-1"], "--beam must be positive"),
        (["--max-contexts", "0"], "--max-contexts must be positive"),
        (["--max-states", "0"], "--max-states must be positive"),
        (["--max-sym-per-frame", "0"], "--max-sym-per-frame must be positive"),
        (["--max-duration", "0"], "--max-duration must be positive"),
        (["--encoder-dim", "64"], "--rnn-hidden-size (32) must be >= --encoder-dim (64)"),
        (["--decoding-method", "beam_search"], "--decoding-method: invalid choice"),
        (["--test-sets", "test-nothing"], "--test-sets: no cut manifest"),
        (["--test-sets", "missing.jsonl.gz"], "--test-sets: no cut manifest missing.jsonl.gz"),
        (["--test-sets", "test-clean", "test-clean"], "--test-sets: test set name 'test-clean' given twice"),
        (["--bpe-model", "nowhere/bpe.model"], "--bpe-model nowhere/bpe.model does not exist"),
    ],
)
def test_bad_flag_values_name_the_flag(tiny_data, capsys, argv, message):
    base = ["--bpe-model", str(tiny_data / BPE), "--manifest-dir", str(tiny_data / "data/fbank"), *TINY_FLAGS]
    assert_flag_error(get_parser(), validate_args, base + argv, message, capsys)


def test_test_sets_accept_part_names_and_manifest_paths(tiny_data, tmp_path):
    fbank = tiny_data / "data/fbank"
    extra = tmp_path / "librispeech_cuts_dev-clean.jsonl.gz"
    shutil.copy(fbank / "librispeech_cuts_dev-clean.jsonl.gz", extra)
    other = tmp_path / "my_cuts.jsonl.gz"
    shutil.copy(fbank / "librispeech_cuts_test-other.jsonl.gz", other)
    resolved = resolve_test_sets(["test-clean", str(extra), str(other)], fbank)
    assert resolved == [
        ("test-clean", fbank / "librispeech_cuts_test-clean.jsonl.gz"),
        ("dev-clean", extra),
        ("my_cuts", other),
    ]
    with pytest.raises(ValueError, match="test set name 'test-other' given twice"):
        resolve_test_sets(["test-other", str(fbank / "librispeech_cuts_test-other.jsonl.gz")], fbank)


# --------------------------------------------------------------------------
# Batch decoding pieces
# --------------------------------------------------------------------------


class _WordPieces:
    """Token ids -> words: a stand-in for the BPE model with a readable mapping."""

    def decode(self, tokens: Sequence[int]) -> str:
        return " ".join(f"w{t}" for t in tokens)


def test_tail_padding_before_the_encoder():
    model = tiny_model(vocab_size=10).eval()
    seen = {}
    encoder_forward = model.encoder.forward

    def recording_forward(x, x_lens, **kwargs):
        seen["x"], seen["x_lens"] = x.clone(), x_lens.clone()
        return encoder_forward(x, x_lens, **kwargs)

    model.encoder.forward = recording_forward
    feature = torch.randn(2, 50, 80)
    batch = {"inputs": feature, "supervisions": {"num_frames": torch.tensor([50, 40])}}
    params = AttributeDict(decoding_method="greedy_search", max_sym_per_frame=1)
    out = decode_one_batch(params, model, _WordPieces(), batch)
    assert list(out) == ["greedy_search"] and len(out["greedy_search"]) == 2
    assert seen["x"].shape == (2, 85, 80)
    assert torch.equal(seen["x"][:, :50], feature)
    assert torch.all(seen["x"][:, 50:] == math.log(1e-10))
    assert seen["x_lens"].tolist() == [85, 75]


def test_search_dispatch_greedy_batch_and_max_sym_per_frame():
    model = tiny_model(vocab_size=10).eval()
    torch.manual_seed(5)
    encoder_out = torch.randn(3, 12, TINY_SIZES["encoder_dim"]) * 3
    lens = torch.tensor([12, 7, 9])
    one = search_tokens(AttributeDict(decoding_method="greedy_search", max_sym_per_frame=1), model, encoder_out, lens)
    assert one == greedy_search_batch(model, encoder_out, lens)
    three = search_tokens(AttributeDict(decoding_method="greedy_search", max_sym_per_frame=3), model, encoder_out, lens)
    assert three == [
        greedy_search(model, encoder_out[i : i + 1, :n], max_sym_per_frame=3) for i, n in enumerate([12, 7, 9])
    ]


# --------------------------------------------------------------------------
# decode.py end to end on the tiny corpus
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoded(tiny_data, tmp_path_factory) -> Dict[str, object]:
    """Three epoch checkpoints of a tiny random model, decoded with all three methods."""
    root = tmp_path_factory.mktemp("decode_e2e")
    exp_dir = root / "exp"
    write_epoch_checkpoints(exp_dir, 3)
    extra = root / f"{EXTRA_SET}.jsonl.gz"
    shutil.copy(tiny_data / "data/fbank/librispeech_cuts_test-clean.jsonl.gz", extra)
    runs = {
        method: run_decode(
            tiny_data,
            "--exp-dir",
            str(exp_dir),
            "--epoch",
            "3",
            "--avg",
            "2",
            "--decoding-method",
            method,
            "--test-sets",
            "test-clean",
            "test-other",
            str(extra),
        )
        for method in SUFFIXES
    }
    manifests = {
        "test-clean": tiny_data / "data/fbank/librispeech_cuts_test-clean.jsonl.gz",
        "test-other": tiny_data / "data/fbank/librispeech_cuts_test-other.jsonl.gz",
        EXTRA_SET: extra,
    }
    return {"exp_dir": exp_dir, "runs": runs, "manifests": manifests}


@pytest.mark.parametrize("method", list(SUFFIXES))
def test_decode_writes_icefall_files(decoded, method):
    run = decoded["runs"][method]
    assert run.returncode == 0, run.stderr[-3000:]
    res_dir = decoded["exp_dir"] / method
    suffix = SUFFIXES[method]
    expected = {f"{kind}-{name}-{suffix}.txt" for kind in ("recogs", "errs", "wer-summary") for name in DECODED_SETS}
    files = {p.name for p in res_dir.iterdir()}
    logs = [f for f in files if f.startswith(f"log-decode-{suffix}-")]
    assert files == expected | set(logs) and len(logs) == 1, sorted(files)
    log_text = (res_dir / logs[0]).read_text()
    exp_dir = decoded["exp_dir"]
    assert f"Loading the averaged model from {exp_dir}/epoch-1.pt (excluded) to {exp_dir}/epoch-3.pt" in log_text
    assert "Device: cpu" in log_text or "Device: cuda" in log_text


@pytest.mark.parametrize("method", list(SUFFIXES))
def test_wer_files_agree_with_recogs_and_manifests(decoded, method):
    res_dir, suffix, key = decoded["exp_dir"] / method, SUFFIXES[method], KEYS[method]
    hyps = {}
    for name in DECODED_SETS:
        hyps.update(check_wer_files(res_dir, name, suffix, key, decoded["manifests"][name]))
    assert any(hyps.values()), "the random model should emit something"


@pytest.mark.parametrize("method", list(SUFFIXES))
def test_printed_table_has_wer_and_rtf(decoded, method):
    run = decoded["runs"][method]
    res_dir, suffix, key = decoded["exp_dir"] / method, SUFFIXES[method], KEYS[method]
    rows = [line.split() for line in run.stdout.splitlines()]
    assert rows[0] == ["test", "set", "setting", "WER", "RTF", "cuts", "audio", "(s)"]
    by_set = {row[0]: row[1:] for row in rows[1:]}
    assert sorted(by_set) == sorted(DECODED_SETS)
    for name in DECODED_SETS:
        setting, wer, rtf, cuts, _ = by_set[name]
        errs_wer = (res_dir / f"errs-{name}-{suffix}.txt").read_text().splitlines()[0].split("= ")[1]
        assert (setting, wer, cuts) == (key, errs_wer, "8")
        assert 0 < float(rtf) < 100
        assert re.search(rf"{name}: decoded 8 cuts, [\d.]+ s of audio in [\d.]+ s, RTF {rtf}", run.stderr)


# --------------------------------------------------------------------------
# decode.py's own error exits
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_exp(tmp_path_factory) -> Path:
    """Two epoch checkpoints of the tiny model, for the error exits."""
    exp_dir = tmp_path_factory.mktemp("decode_errors")
    write_epoch_checkpoints(exp_dir, 2)
    return exp_dir


def _main_error(tiny_data: Path, *argv: str) -> str:
    """decode.py as a user runs it, in the tiny corpus's work dir; assert it exits 1 without a traceback and
    return its stderr."""
    run = run_decode(tiny_data, *argv)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    return run.stderr


def test_main_avg_too_large_exits_with_the_file_names(tiny_data, small_exp):
    err = _main_error(tiny_data, "--exp-dir", str(small_exp), "--epoch", "2", "--avg", "2")
    assert (
        "decode.py: error: --avg 2 is too large for --epoch 2: --use-averaged-model true averages the model between "
        "epoch-(EPOCH-AVG).pt (excluded) and epoch-2.pt, so --avg must be below --epoch; use --avg 1 or less, or "
        f"--use-averaged-model false. Found in {small_exp}: epoch-1.pt, epoch-2.pt." in err
    )


def test_main_other_model_size_exits_with_mismatched_shapes(tiny_data, small_exp):
    flags = ["--decoder-dim", "40"]  # after run_decode's TINY_FLAGS: a later flag wins
    err = _main_error(tiny_data, "--exp-dir", str(small_exp), "--epoch", "2", "--avg", "1", *flags)
    assert "decode.py: error: the averaged model from" in err
    assert "Mismatched shapes:" in err
    assert re.search(r"decoder\.embedding\.weight: checkpoint \(100, 32\) vs model \(100, 40\)", err), err


def test_main_nan_features_exit_naming_the_cut_without_result_files(tiny_data, small_exp, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_data)  # feature paths in the tiny manifests are relative to its work dir
    cuts = list(load_manifest(tiny_data / "data/fbank/librispeech_cuts_test-clean.jsonl.gz"))[:3]
    victim = cuts[1]
    feats = victim.load_features().copy()
    feats[5, 11] = np.nan
    cuts[1] = with_features(victim, feats, tmp_path / "feats")
    manifest = tmp_path / "nan_cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(manifest)
    exp_dir = tmp_path / "exp"
    shutil.copytree(small_exp, exp_dir)
    err = _main_error(tiny_data, "--exp-dir", str(exp_dir), "--epoch", "2", "--avg", "1", "--test-sets", str(manifest))
    assert f"decode.py: error: NaN/inf in the features of cut(s) [{victim.id!r}]" in err, err
    assert not list((exp_dir / "greedy_search").glob("recogs-*")), "no result files from a failed test set"
