"""export.py, pretrained.py and onnx_pretrained.py on the tiny corpus's synthetic speech (espeak-ng and flite,
written here by sox at 8, 22.05 and 44.1 kHz, stereo, FLAC and WAV): reading a file gives sox's 16 kHz mono
samples to within a resampler's difference, the transcripts equal decode.py's and sherpa_onnx_decode.py's on the
samples the scripts read, a long file decodes chunk by chunk to its whole-file text, and every bad input is named
while the other files are transcribed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import soundfile as sf
import torch
from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet
from lhotse.features.io import NumpyFilesWriter
from test_decode import BPE, TINY_FLAGS, TINY_SIZES, VOCAB_SIZE, lean_to_blank, tiny_model, write_epoch_checkpoints

from conftest import RECIPE, read_recogs, recipe_env, tiny_transducer
from icefall_lite.data.audio import AudioFileError, audio_blocks, read_audio, sound_files
from icefall_lite.data.fbank_stream import FbankStream
from icefall_lite.data.features import fbank_extractor
from icefall_lite.decoding.checkpoint_fit import model_sizes
from icefall_lite.decoding.chunked import encoder_windows
from icefall_lite.decoding.streaming import chunk_starts
from icefall_lite.nn.model import MODEL_PRESETS

SCRIPTS = RECIPE / "lstm_transducer_stateless"
METHODS = ("greedy_search", "modified_beam_search", "fast_beam_search")
# name -> (sample rate, channels, format) of the test files made from the tiny corpus's 16 kHz FLAC
VARIANTS = {
    "a-8k.wav": (8000, 1, "WAV"),
    "b-22k-stereo.flac": (22050, 2, "FLAC"),
    "c-44k-stereo.wav": (44100, 2, "WAV"),
    "d-16k.flac": (16000, 1, "FLAC"),
}


def run(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**recipe_env(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPTS / script), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def transcripts(stdout: str) -> Dict[str, str]:
    """{file: text} of pretrained.py's stdout (icefall's ``<file>:`` line, then the text line)."""
    lines = stdout.splitlines()
    return {lines[i][:-1]: lines[i + 1] for i in range(len(lines)) if lines[i].endswith(":")}


def sox(*args: object) -> None:
    subprocess.run(["sox", *map(str, args)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def audio(tiny_data, tmp_path_factory) -> Dict[str, object]:
    """The test files (VARIANTS; the stereo ones with the right channel at half the left), each one's 16 kHz mono
    reference written by sox (float WAV), a long file of 8 utterances, and a cut manifest with lossless (numpy)
    fbank of the samples ``read_audio`` gives for each test file.

    The manifest holds the samples the scripts read, not sox's: soxr and sox's rate effect differ by up to 2e-3,
    and a random model's beam can turn on less (CI saw one 44.1 kHz file's modified beam search differ). Reading
    is checked against sox on its own (test_read_audio_matches_sox_and_blocks_match_whole)."""
    root = tmp_path_factory.mktemp("pretrained_audio")
    flacs = sorted((tiny_data / "download/LibriSpeech/test-clean").rglob("*.flac"))
    files, refs = {}, {}
    for (name, (rate, channels, fmt)), src in zip(VARIANTS.items(), flacs):
        samples, sr = sf.read(src, dtype="float32")
        if channels == 2:
            samples = np.stack([samples, 0.5 * samples], axis=1)
        raw = root / f"raw-{name}.wav"
        sf.write(raw, samples, sr, subtype="FLOAT")
        files[name] = root / name
        sox(raw, "-b", "16", "-r", rate, files[name])  # 16-bit PCM, as recordings are
        refs[name] = root / f"ref-{Path(name).stem}.wav"
        sox(files[name], "-e", "floating-point", "-b", "32", "-r", 16000, "-c", 1, refs[name])
        sf.write(root / f"read-{Path(name).stem}.wav", read_audio(files[name]), 16000, subtype="FLOAT")
    long_file = root / "long.flac"
    sox(*flacs[:8], long_file)
    reads = {Path(n).stem: root / f"read-{Path(n).stem}.wav" for n in VARIANTS}
    recs = RecordingSet.from_recordings(Recording.from_file(path, recording_id=rec) for rec, path in reads.items())
    sups = SupervisionSet.from_segments(
        SupervisionSegment(id=r.id, recording_id=r.id, start=0, duration=r.duration, text="X") for r in recs
    )
    cuts = CutSet.from_manifests(recordings=recs, supervisions=sups).compute_and_store_features(
        fbank_extractor(), root / "feats", storage_type=NumpyFilesWriter
    )
    cuts.to_file(root / "refs.jsonl.gz")
    return {"root": root, "files": files, "refs": refs, "long": long_file, "manifest": root / "refs.jsonl.gz"}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    """exp/pretrained.pt of a random tiny model leaning to blank (test_decode's)."""
    exp = tmp_path_factory.mktemp("pretrained_model")
    torch.save({"model": lean_to_blank(tiny_model(seed=1)).state_dict()}, exp / "pretrained.pt")
    return exp / "pretrained.pt"


def pretrained(tiny_data: Path, model_file: Path, *args: object) -> subprocess.CompletedProcess:
    return run("pretrained.py", tiny_data, "--checkpoint", model_file, "--bpe-model", BPE, *TINY_FLAGS, *args)


# --------------------------------------------------------------------------
# The pieces: reading, fbank, windows, checkpoint sizes, file lists
# --------------------------------------------------------------------------


def test_read_audio_matches_sox_and_blocks_match_whole(audio, monkeypatch):
    for name, (rate, channels, _) in VARIANTS.items():
        got = read_audio(audio["files"][name])
        want, sr = sf.read(audio["refs"][name], dtype="float32")
        assert sr == 16000 and got.ndim == 1 and abs(got.size - want.size) <= 1
        n = min(got.size, want.size)
        assert np.abs(got[:n] - want[:n]).max() < 2e-3, name  # soxr against sox's own rate effect
        assert np.abs(want).max() > 0.05  # speech, not silence
        blocks = list(audio_blocks(audio["files"][name], block_seconds=0.37))
        assert len(blocks) > 3 and np.array_equal(np.concatenate(blocks), got)


def test_fbank_stream_equals_whole_fbank():
    rng = np.random.default_rng(0)
    for n, block in [(1360, 100), (50_000, 4_000), (112_037, 7_777)]:
        x = (0.1 * rng.standard_normal(n)).astype(np.float32)
        want = torch.from_numpy(fbank_extractor().extract(x, 16000))
        stream = FbankStream()
        got = torch.cat([*(stream.accept(x[i : i + block]) for i in range(0, n, block)), stream.finish()])
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("num_frames", [9, 150, 161, 163, 1003])
def test_encoder_windows(num_frames):
    torch.manual_seed(0)
    model = tiny_transducer(vocab_size=VOCAB_SIZE, **TINY_SIZES).eval()
    feats = torch.randn(num_frames, 80)
    blocks = list(feats.split(37))
    # sherpa-onnx's rule: chunk_starts' windows
    assert len(list(encoder_windows(blocks, 4, sherpa=True))) == len(chunk_starts(num_frames, 9, 4))
    # the whole-file rule: the encoder output of the whole utterance, frame for frame
    with torch.no_grad():
        want, want_lens, _ = model.encoder(feats.unsqueeze(0), torch.tensor([num_frames]))
        states, outs = model.get_init_states(1), []
        for window in encoder_windows(blocks, 16, sherpa=False):
            out, states = model.encoder.streaming_forward(window.unsqueeze(0), states)
            outs.append(out)
    got = torch.cat(outs, dim=1)
    assert got.shape == want.shape and want_lens.item() == want.size(1)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("sizes", [TINY_SIZES, {**TINY_SIZES, "rnn_hidden_size": 48}, MODEL_PRESETS["cpu"]])
@pytest.mark.parametrize("context_size", [1, 2])
def test_model_sizes_of_a_state_dict(sizes, context_size):
    model = tiny_transducer(vocab_size=37, context_size=context_size, **sizes)
    assert model_sizes(model.state_dict()) == {**sizes, "context_size": context_size, "vocab_size": 37}
    assert model_sizes({"model.weight": torch.zeros(2)}) is None


def test_sound_files_expands_folders_and_lists(tmp_path):
    (tmp_path / "dir/sub").mkdir(parents=True)
    for name in ("dir/b.wav", "dir/sub/a.FLAC", "dir/notes.md", "x.ogg"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "list.txt").write_text(f"# a list\nx.ogg\n\n{tmp_path}/dir/b.wav\nmissing.mp3\n")
    got = sound_files([tmp_path / "dir", tmp_path / "list.txt", tmp_path / "x.ogg"])
    assert got == [tmp_path / "dir/b.wav", tmp_path / "dir/sub/a.FLAC", tmp_path / "x.ogg", tmp_path / "missing.mp3"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(AudioFileError, match="no sound files"):
        sound_files([tmp_path / "empty"])


# --------------------------------------------------------------------------
# pretrained.py against decode.py; chunked against whole
# --------------------------------------------------------------------------


def recogs_texts(recogs: Path) -> Dict[str, str]:
    """{recording id: hypothesis} of an icefall recogs file of the references' manifest (cut id: <rec>-<index>)."""
    return {re.sub(r"-\d+$", "", cut_id): " ".join(hyp) for cut_id, (_, hyp) in read_recogs(recogs).items()}


def decode_py_hyps(tiny_data: Path, model_file: Path, manifest: Path, method: str, exp_dir: Path) -> Dict[str, str]:
    """{recording id: text} of decode.py on ``manifest``."""
    args = ["--checkpoint", model_file, "--exp-dir", exp_dir, "--bpe-model", BPE, "--num-workers", "0"]
    done = run("decode.py", tiny_data, *args, *TINY_FLAGS, "--decoding-method", method, "--test-sets", manifest)
    assert done.returncode == 0, done.stderr[-3000:]
    (recogs,) = (exp_dir / method).glob("recogs-refs-*.txt")
    return recogs_texts(recogs)


@pytest.mark.parametrize("method", METHODS)
def test_pretrained_equals_decode_py(tiny_data, audio, model_file, method, tmp_path):
    want = decode_py_hyps(tiny_data, model_file, audio["manifest"], method, tmp_path / "exp")
    done = pretrained(tiny_data, model_file, "--method", method, *audio["files"].values())
    assert done.returncode == 0, done.stderr[-3000:]
    got = transcripts(done.stdout)
    assert {Path(f).stem: text for f, text in got.items()} == want
    assert sum(len(t.split()) for t in want.values()) >= 4  # the model says something
    assert "Decoding Done" in done.stderr and "transcribing" in done.stderr  # icefall's last line, the bar


@pytest.mark.parametrize("method", METHODS)
def test_long_file_chunked_equals_whole(tiny_data, audio, model_file, method, monkeypatch):
    duration = sf.info(audio["long"]).duration
    assert duration > 15
    whole = pretrained(tiny_data, model_file, "--method", method, audio["long"])
    chunked = pretrained(tiny_data, model_file, "--method", method, "--max-duration", 10, audio["long"])
    assert whole.returncode == chunked.returncode == 0, chunked.stderr[-3000:]
    assert "decoded chunk by chunk" in chunked.stderr and "decoded chunk by chunk" not in whole.stderr
    text = transcripts(whole.stdout)[str(audio["long"])]
    assert len(text.split()) >= 3
    assert transcripts(chunked.stdout) == {str(audio["long"]): text}


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------


def bad_files(root: Path) -> Dict[str, Path]:
    """One file of each kind pretrained.py must refuse, and the reason it must give."""
    root.mkdir(exist_ok=True)
    (root / "empty.wav").write_bytes(b"")
    (root / "text.wav").write_text("not audio at all\n" * 20)
    sf.write(root / "no-samples.wav", np.zeros(0, dtype=np.float32), 16000)
    sf.write(root / "short.flac", np.full(800, 0.1, dtype=np.float32), 16000)  # 0.05 s
    return {
        "no such file": root / "missing.wav",
        "empty file (0 bytes)": root / "empty.wav",
        "cannot read it as audio": root / "text.wav",
        "no audio in it (0 samples)": root / "no-samples.wav",
        "too short: 800 samples": root / "short.flac",
    }


@pytest.mark.parametrize("script", ["pretrained.py", "onnx_pretrained.py"])
def test_bad_files_are_named_and_the_others_transcribed(tiny_data, audio, model_file, onnx_files, script, tmp_path):
    bad = bad_files(tmp_path)
    good = [audio["files"]["a-8k.wav"], audio["files"]["d-16k.flac"]]
    files = [good[0], *bad.values(), good[1]]
    if script == "pretrained.py":
        done = pretrained(tiny_data, model_file, *files)
    else:
        done = run(script, tiny_data, *onnx_files, *files)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert sorted(transcripts(done.stdout)) == sorted(map(str, good))
    for reason, path in bad.items():
        assert re.search(rf"ERROR .*{re.escape(str(path))}: {re.escape(reason)}", done.stderr), reason
    assert "5 of 7 file(s) were not transcribed" in done.stderr


@pytest.mark.parametrize(
    "flags, fits",
    [
        (["--model-preset", "icefall"], "It fits: --num-encoder-layers 2 --encoder-dim 32 --rnn-hidden-size 32"),
        (TINY_FLAGS, "It fits: --model-preset cpu."),
    ],
)
def test_checkpoint_of_other_sizes_names_tensors_and_fitting_flags(tiny_data, audio, model_file, flags, fits, tmp_path):
    if flags is TINY_FLAGS:  # a checkpoint of the cpu preset given the tiny sizes
        cpu = tiny_transducer(vocab_size=VOCAB_SIZE, **MODEL_PRESETS["cpu"])
        torch.save({"model": cpu.state_dict()}, tmp_path / "cpu.pt")
        model_file = tmp_path / "cpu.pt"
    args = ["--checkpoint", model_file, "--bpe-model", BPE, *flags, audio["files"]["d-16k.flac"]]
    done = run("pretrained.py", tiny_data, *args)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "pretrained.py: error:" in done.stderr and "does not fit this model" in done.stderr
    assert "encoder.encoder_embed.out.weight: checkpoint" in done.stderr  # the differing tensors
    assert fits in done.stderr


# --------------------------------------------------------------------------
# export.py
# --------------------------------------------------------------------------


def test_export_writes_the_averaged_model_only(tiny_data, tmp_path):
    exp = tmp_path / "exp"
    write_epoch_checkpoints(exp, 3)  # model_avg = mean of the models so far, 10 batches an epoch
    done = run("export.py", tiny_data, "--exp-dir", exp, "--epoch", 3, "--avg", 2, "--bpe-model", BPE, *TINY_FLAGS)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = torch.load(exp / "pretrained.pt", weights_only=True)
    assert list(saved) == ["model"]
    # between epoch-1 (excluded) and epoch-3: (3 * mean(m1..m3) * 10 - m1 * 10) / 20 = mean(m2, m3)
    m2, m3 = (lean_to_blank(tiny_model(seed=s)).state_dict() for s in (2, 3))
    assert list(saved["model"]) == list(m3)
    for name, value in saved["model"].items():
        if value.dtype.is_floating_point:
            torch.testing.assert_close(value, (m2[name] + m3[name]) / 2, rtol=1e-5, atol=1e-6)
    bad = run("export.py", tiny_data, "--exp-dir", exp, "--epoch", 3, "--avg", 2, "--bpe-model", BPE)
    assert bad.returncode == 1 and "export.py: error:" in bad.stderr and "It fits: --num-encoder-layers 2" in bad.stderr


# --------------------------------------------------------------------------
# onnx_pretrained.py against sherpa_onnx_decode.py
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def onnx_files(tiny_data, model_file) -> List[object]:
    """onnx_pretrained.py's model flags for export_onnx.py's files of ``model_file``."""
    exp = model_file.parent
    args = ["--checkpoint", model_file, "--exp-dir", exp, "--int8", "false", *TINY_FLAGS]
    done = run("export_onnx.py", tiny_data, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    flags = [[f"--{part}-model-filename", exp / f"{part}-pretrained.onnx"] for part in ("encoder", "decoder", "joiner")]
    return [*sum(flags, []), "--tokens", exp / "tokens.txt"]


@pytest.mark.parametrize("method", ["greedy_search", "modified_beam_search"])
def test_onnx_pretrained_equals_sherpa_onnx_decode(tiny_data, audio, model_file, onnx_files, method, tmp_path):
    args = ["--checkpoint", model_file, "--exp-dir", tmp_path, "--onnx-dir", model_file.parent]
    args += ["--decoding-method", method, "--test-sets", audio["manifest"]]
    sherpa = run("sherpa_onnx_decode.py", tiny_data, *args)
    assert sherpa.returncode == 0, sherpa.stderr[-3000:]
    (recogs,) = (tmp_path / "sherpa-onnx" / method).glob("recogs-refs-*.txt")
    want = recogs_texts(recogs)
    files = [*audio["files"].values(), audio["long"]]
    done = run("onnx_pretrained.py", tiny_data, *onnx_files, "--method", method, "--max-duration", 10, *files)
    assert done.returncode == 0, done.stderr[-3000:]
    got = transcripts(done.stdout)
    assert {Path(f).stem: t for f, t in got.items() if Path(f).stem in want} == want
    assert sum(len(t.split()) for t in want.values()) >= 4
    # the long file, chunk by chunk, as onnx_pretrained.py decodes it whole
    whole = run("onnx_pretrained.py", tiny_data, *onnx_files, "--method", method, audio["long"])
    assert transcripts(whole.stdout) == {str(audio["long"]): got[str(audio["long"])]}
