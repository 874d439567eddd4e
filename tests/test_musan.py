"""Real MUSAN's path (icefall_lite.data.musan, prepare.sh stage 3 with --corpus librispeech) on a small
tree in MUSAN's layout that the test builds: music/, speech/ and noise/ folders of short WAVs."""

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
import soundfile as sf
from lhotse import load_manifest

from conftest import RECIPE, recipe_env
from icefall_lite.data.datamodule import LibriSpeechAsrDataModule
from icefall_lite.data.layout import MUSAN_CUTS_NAME, NOISE_CUTS_NAME
from icefall_lite.data.musan import MusanError, check_musan_dir

SR = 16000
# recording id -> seconds. 10 s windows, those of 5 s or less dropped: 23 s -> 10 + 10 (3 dropped),
# 7 s -> 7, 12 s -> 10 (2 dropped), 4 s -> nothing.
RECORDINGS: Dict[str, float] = {
    "music/fma/music-fma-0000": 23.0,
    "speech/librivox/speech-librivox-0000": 7.0,
    "noise/free-sound/noise-free-sound-0000": 12.0,
    "noise/free-sound/noise-free-sound-0001": 4.0,
}
EXPECTED_WINDOWS = sorted([10.0, 10.0, 7.0, 10.0])
COMPUTE = RECIPE / "local" / "compute_fbank_musan.py"


def build_musan_tree(root: Path) -> Path:
    musan = root / "musan"
    rng = np.random.default_rng(0)
    for name, seconds in RECORDINGS.items():
        path = musan / f"{name}.wav"
        path.parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(path), (0.05 * rng.standard_normal(int(seconds * SR))).astype(np.float32), SR, subtype="PCM_16")
    # MUSAN's music annotations: id, genres, vocals (Y/N), artist
    (musan / "music" / "fma" / "ANNOTATIONS").write_text("music-fma-0000 classical N someone\n")
    return musan


def run(cmd, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env=recipe_env(), timeout=600)


def check_musan_cuts(fbank_dir: Path) -> None:
    cuts = load_manifest(fbank_dir / MUSAN_CUTS_NAME)
    assert sorted(round(c.duration, 3) for c in cuts) == EXPECTED_WINDOWS
    assert {c.recording_id for c in cuts} == {Path(n).name for n, s in RECORDINGS.items() if s > 5}
    for cut in cuts:
        feats = cut.load_features()
        assert feats.shape[1] == 80 and abs(feats.shape[0] - 100 * cut.duration) <= 2
        assert np.isfinite(feats).all()


def test_compute_fbank_musan_windows_filters_and_stores_features(tmp_path: Path) -> None:
    musan = build_musan_tree(tmp_path)
    proc = run(
        [
            sys.executable,
            COMPUTE,
            "--musan-dir",
            musan,
            "--manifest-dir",
            tmp_path / "manifests",
            "--fbank-dir",
            tmp_path / "fbank",
            "--nj",
            "1",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    check_musan_cuts(tmp_path / "fbank")
    for part in ("music", "speech", "noise"):
        assert (tmp_path / "manifests" / f"musan_recordings_{part}.jsonl.gz").is_file()
    assert len(load_manifest(tmp_path / "manifests" / "musan_supervisions_music.jsonl.gz")) == 1


def test_missing_or_incomplete_musan_folder_is_a_clear_error(tmp_path: Path) -> None:
    proc = run([sys.executable, COMPUTE, "--musan-dir", tmp_path / "nowhere", "--nj", "1"], cwd=tmp_path)
    assert proc.returncode != 0
    assert (
        f"no MUSAN folder at {tmp_path / 'nowhere'}" in proc.stderr and "prepare.sh --corpus librispeech" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    musan = build_musan_tree(tmp_path)
    for wav in (musan / "speech").rglob("*.wav"):
        wav.unlink()
    with pytest.raises(MusanError, match=r"speech is missing or has no \.wav files"):
        check_musan_dir(musan)
    assert not (tmp_path / "data" / "fbank" / MUSAN_CUTS_NAME).exists()


def test_prepare_sh_stage_3_downloads_musan_from_a_mirror_and_prepares_it(tmp_path: Path, monkeypatch) -> None:
    """--corpus librispeech: stage 3 downloads musan.tar.gz (here from a file:// mirror) with lhotse,
    unpacks it into DL_DIR/musan and writes data/fbank/musan_cuts.jsonl.gz; a rerun skips the stage."""
    musan = build_musan_tree(tmp_path / "src")
    archive = tmp_path / "mirror" / "musan.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(musan, arcname="musan")
    work = tmp_path / "work"
    cmd = [
        "bash",
        RECIPE / "prepare.sh",
        "--corpus",
        "librispeech",
        "--stage",
        "3",
        "--stop-stage",
        "3",
        "--work-dir",
        work,
        "--nj",
        "1",
        "--musan-url",
        archive.as_uri(),
    ]
    proc = run(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (work / "download" / "musan" / "noise" / "free-sound" / "noise-free-sound-0000.wav").is_file()
    monkeypatch.chdir(work)  # feature paths are relative to the work dir, as in icefall
    check_musan_cuts(work / "data" / "fbank")
    assert not (work / "data" / "fbank" / NOISE_CUTS_NAME).exists()
    again = run(cmd, cwd=tmp_path)
    assert again.returncode == 0 and "already done" in again.stdout


def _datamodule(fbank_dir: Path) -> LibriSpeechAsrDataModule:
    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=100.0)
    return LibriSpeechAsrDataModule(parser.parse_args(["--manifest-dir", str(fbank_dir)]))


def test_training_mixes_musan_when_prepared_else_the_noise_corpus(tmp_path: Path) -> None:
    fbank = tmp_path / "fbank"
    with pytest.raises(FileNotFoundError, match=f"neither {MUSAN_CUTS_NAME} nor {NOISE_CUTS_NAME}"):
        _datamodule(fbank).noise_cuts()
    musan = build_musan_tree(tmp_path)
    assert (
        run(
            [
                sys.executable,
                COMPUTE,
                "--musan-dir",
                musan,
                "--manifest-dir",
                tmp_path / "manifests",
                "--fbank-dir",
                fbank,
                "--nj",
                "1",
            ],
            cwd=tmp_path,
        ).returncode
        == 0
    )
    musan_ids = sorted(c.id for c in _datamodule(fbank).noise_cuts())
    assert musan_ids == sorted(c.id for c in load_manifest(fbank / MUSAN_CUTS_NAME)) and len(musan_ids) == 4
    # A noise-corpus manifest next to MUSAN's is not used; alone, it is.
    noise_corpus = load_manifest(fbank / MUSAN_CUTS_NAME).subset(first=2)
    noise_corpus.to_file(fbank / NOISE_CUTS_NAME)
    assert sorted(c.id for c in _datamodule(fbank).noise_cuts()) == musan_ids
    (fbank / MUSAN_CUTS_NAME).unlink()
    assert sorted(c.id for c in _datamodule(fbank).noise_cuts()) == sorted(c.id for c in noise_corpus)
