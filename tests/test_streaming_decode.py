"""streaming_decode.py and sherpa_onnx_decode.py end to end on the tiny corpus: icefall's WER files, and
hypotheses equal to references computed here without the scripts (and, for greedy, without chunks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
import pytest
import sentencepiece as spm
import torch
from lhotse import CutSet, load_manifest
from test_decode import BPE, TINY_FLAGS, TINY_SIZES, VOCAB_SIZE, write_epoch_checkpoints

from conftest import RECIPE, assert_flag_error, check_wer_files, recipe_env, reference_streaming_greedy, tiny_transducer
from icefall_lite.data.features import LOG_EPS, NUM_TAIL_PADDED_FRAMES, fbank_extractor
from icefall_lite.decoding.cli import get_streaming_parser, validate_streaming_args
from icefall_lite.decoding.constants import TEST_SETS
from icefall_lite.decoding.streaming import streaming_search
from icefall_lite.export.onnx_export import build_exportable
from icefall_lite.export.sherpa import tail_padding
from icefall_lite.train.averaging import load_averaged_weights

SCRIPTS = RECIPE / "lstm_transducer_stateless"
STREAMING = SCRIPTS / "streaming_decode.py"
SHERPA = SCRIPTS / "sherpa_onnx_decode.py"
KEYS = {"greedy_search": "greedy_search", "modified_beam_search": "beam_size_4"}
STREAMING_SUFFIXES = {
    "greedy_search": "epoch-3-avg-2-context-2-max-sym-per-frame-1-use-averaged-model-decode-chunk-len-4",
    "modified_beam_search": "epoch-3-avg-2-modified_beam_search-beam-size-4-use-averaged-model-decode-chunk-len-4",
}
SHERPA_SUFFIXES = {
    "greedy_search": "epoch-3-avg-2-context-2-max-sym-per-frame-1-decode-chunk-len-4",
    "modified_beam_search": "epoch-3-avg-2-modified_beam_search-beam-size-4-decode-chunk-len-4",
}
UNK_ID = 2
# kaldi-native-fbank (sherpa-onnx) floors mel energies at FLT_EPSILON, lhotse at 1e-10
LOG_FLT_EPSILON = float(np.log(np.finfo(np.float32).eps))


def run_script(script: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    env = recipe_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=work, capture_output=True, text=True, env=env, timeout=300
    )


def words(sp: spm.SentencePieceProcessor, hyps: List[List[int]]) -> List[List[str]]:
    return [sp.decode(tokens).split() for tokens in hyps]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices in per-frame loops: a second OpenMP thread only spins on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exp(tiny_data, tmp_path_factory) -> Dict[str, object]:
    """Three epoch checkpoints of the tiny model, and the model that --epoch 3 --avg 2 selects, loaded here."""
    exp_dir = tmp_path_factory.mktemp("streaming") / "exp"
    write_epoch_checkpoints(exp_dir, 3)
    model = tiny_transducer(vocab_size=VOCAB_SIZE, **TINY_SIZES)
    load_averaged_weights(model, exp_dir, epoch=3, avg=2, use_averaged_model=True, device=torch.device("cpu"))
    sp = spm.SentencePieceProcessor(model_file=str(tiny_data / BPE))
    return {"dir": exp_dir, "model": model.eval(), "sp": sp}


# --------------------------------------------------------------------------
# streaming_decode.py
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streamed(tiny_data, exp) -> Dict[str, subprocess.CompletedProcess]:
    return {
        method: run_script(
            STREAMING,
            tiny_data,
            "--exp-dir",
            str(exp["dir"]),
            "--epoch",
            "3",
            "--avg",
            "2",
            "--bpe-model",
            BPE,
            "--num-workers",
            "0",
            "--decoding-method",
            method,
            *TINY_FLAGS,
        )
        for method in KEYS
    }


@pytest.mark.parametrize("method", list(KEYS))
def test_streaming_decode_writes_icefall_files_with_reference_hyps(tiny_data, exp, streamed, method, monkeypatch):
    monkeypatch.chdir(tiny_data)  # the manifests' feature paths are relative to it
    run = streamed[method]
    assert run.returncode == 0, run.stderr[-3000:]
    res_dir, suffix = exp["dir"] / "streaming" / method, STREAMING_SUFFIXES[method]
    names = {p.name for p in res_dir.iterdir()}
    logs = [n for n in names if n.startswith(f"log-decode-{suffix}-")]
    want = {f"{kind}-{s}-{suffix}.txt" for kind in ("recogs", "errs", "wer-summary") for s in TEST_SETS}
    assert names == want | set(logs) and len(logs) == 1, sorted(names)
    hyps = {}
    for name in TEST_SETS:
        manifest = tiny_data / f"data/fbank/librispeech_cuts_{name}.jsonl.gz"
        hyps.update(check_wer_files(res_dir, name, suffix, KEYS[method], manifest))
        assert re.search(rf"{name}: decoded 8 cuts, [\d.]+ s of audio in [\d.]+ s, RTF [\d.]+", run.stderr)
    # test-clean again: the same features, decode.py's tail padding, and a search computed here
    cuts = load_manifest(tiny_data / "data/fbank/librispeech_cuts_test-clean.jsonl.gz")
    feats = [
        torch.cat([torch.from_numpy(c.load_features()), torch.full((NUM_TAIL_PADDED_FRAMES, 80), LOG_EPS)])
        for c in cuts
    ]
    if method == "greedy_search":
        ref = [reference_streaming_greedy(exp["model"], f, unk_id=UNK_ID) for f in feats]
    else:
        ex = build_exportable(exp["model"])
        ref = [streaming_search(ex, [f], method, beam_size=4, unk_id=UNK_ID)[0] for f in feats]
    assert [hyps[c.id] for c in cuts] == words(exp["sp"], ref)
    assert sum(map(len, ref)) >= 10, "the model should emit tokens, or the comparison is empty"


def test_streaming_decode_flag_errors(tiny_data, exp, capsys):
    base = ["--exp-dir", str(exp["dir"]), "--bpe-model", str(tiny_data / BPE), *TINY_FLAGS]
    base += ["--manifest-dir", str(tiny_data / "data/fbank")]
    parser = get_streaming_parser()
    for argv, message in [
        (["--decode-chunk-len", "6"], "--decode-chunk-len must be a positive multiple of 4, got 6"),
        (["--decoding-method", "fast_beam_search"], "invalid choice: 'fast_beam_search'"),
        (["--num-threads", "0"], "--num-threads must be positive, got 0"),
    ]:
        assert_flag_error(parser, validate_streaming_args, base + argv, message, capsys)


def test_streaming_decode_avg_too_large_exits_without_traceback(tiny_data, exp):
    run = run_script(
        STREAMING,
        tiny_data,
        "--exp-dir",
        str(exp["dir"]),
        "--bpe-model",
        BPE,
        *TINY_FLAGS,
        "--epoch",
        "3",
        "--avg",
        "3",
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "streaming_decode.py: error: --avg 3 is too large for --epoch 3" in run.stderr
    assert "Traceback" not in run.stderr


# --------------------------------------------------------------------------
# export_onnx.py + sherpa_onnx_decode.py
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tiny_data, exp) -> Path:
    """export_onnx.py --epoch 3 --avg 2 (fp32 and int8) into exp_dir."""
    run = run_script(
        SCRIPTS / "export_onnx.py",
        tiny_data,
        "--exp-dir",
        str(exp["dir"]),
        "--epoch",
        "3",
        "--avg",
        "2",
        "--bpe-model",
        BPE,
        *TINY_FLAGS,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return exp["dir"]


@pytest.fixture(scope="module")
def few_cuts(tiny_data, tmp_path_factory) -> Path:
    """Three cuts of test-other (their recordings are the tiny corpus's FLAC files)."""
    cuts = load_manifest(tiny_data / "data/fbank/librispeech_cuts_test-other.jsonl.gz").subset(first=3)
    path = tmp_path_factory.mktemp("few") / "librispeech_cuts_few.jsonl.gz"
    cuts.to_file(path)
    return path


def sherpa_reference(exp: Dict[str, object], cuts: CutSet, method: str) -> List[List[str]]:
    """What sherpa-onnx should decode: lhotse fbank of audio + tail zeros (kaldi-native-fbank's energy floor),
    searched chunk by chunk with the PyTorch wrappers."""
    ex = build_exportable(exp["model"])
    feats = []
    for cut in cuts:
        audio = np.concatenate([cut.load_audio()[0], tail_padding(cut.sampling_rate)])
        fbank = torch.from_numpy(fbank_extractor().extract(audio, cut.sampling_rate))
        feats.append(fbank.clamp(min=LOG_FLT_EPSILON))
    return words(exp["sp"], streaming_search(ex, feats, method, beam_size=4, unk_id=UNK_ID))


@pytest.mark.parametrize("method", list(KEYS))
def test_sherpa_onnx_decode_writes_icefall_files_with_reference_hyps(tiny_data, exp, exported, few_cuts, method):
    run = run_script(
        SHERPA,
        tiny_data,
        "--exp-dir",
        str(exported),
        "--epoch",
        "3",
        "--avg",
        "2",
        "--decoding-method",
        method,
        "--num-streams",
        "2",
        "--test-sets",
        str(few_cuts),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res_dir, suffix = exported / "sherpa-onnx" / method, SHERPA_SUFFIXES[method]
    hyps = check_wer_files(res_dir, "few", suffix, KEYS[method], few_cuts)
    assert re.search(r"few: decoded 3 cuts, [\d.]+ s of audio in [\d.]+ s, RTF [\d.]+", run.stderr)
    cuts = load_manifest(few_cuts)
    ref = sherpa_reference(exp, cuts, method)
    assert [hyps[c.id] for c in cuts] == ref
    assert sum(map(len, ref)) >= 5, "the model should emit words, or the comparison is empty"


def test_sherpa_onnx_decode_int8_and_errors(tiny_data, exp, exported, few_cuts, tmp_path):
    base = ["--exp-dir", str(exported), "--epoch", "3", "--avg", "2", "--test-sets", str(few_cuts)]
    run = run_script(SHERPA, tiny_data, *base, "--int8", "true")
    assert run.returncode == 0, run.stderr[-3000:]
    suffix = SHERPA_SUFFIXES["greedy_search"] + "-int8"
    check_wer_files(exported / "sherpa-onnx" / "greedy_search", "few", suffix, "greedy_search", few_cuts)

    run = run_script(SHERPA, tiny_data, *base[:2], "--epoch", "4", "--avg", "2")
    assert run.returncode == 2
    assert f"{exported}/encoder-epoch-4-avg-2.onnx does not exist: run export_onnx.py" in run.stderr

    no_audio = tmp_path / "no_audio.jsonl.gz"
    load_manifest(few_cuts).drop_recordings().to_file(no_audio)
    run = run_script(SHERPA, tiny_data, *base[:6], "--test-sets", str(no_audio))
    first = next(iter(load_manifest(few_cuts))).id
    assert run.returncode == 1
    assert f"sherpa_onnx_decode.py: error: cut {first} has no recording" in run.stderr
    assert "Traceback" not in run.stderr
