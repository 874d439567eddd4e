"""Manifests, download, fbank and validation on hand-made LibriSpeech trees
(generated tones, no TTS), including bad audio and bad transcripts."""

import logging
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import soundfile as sf
from lhotse import load_manifest
from lhotse.utils import fastcopy

from icefall_lite.data.features import (
    ManifestError,
    compute_fbank_librispeech,
    librispeech_cuts_path,
    validate_cut,
    validate_cut_manifest,
)
from icefall_lite.data.manifests import (
    audio_error,
    download_librispeech,
    manifest_paths,
    prepare_librispeech_manifests,
    report_manifests,
)
from icefall_lite.data.text_norm import TranscriptError

SR = 16000


def write_tree(corpus: Path, part: str, utts: List[Tuple[str, str, float]]) -> Dict[str, Path]:
    """A LibriSpeech part of tone FLACs: ``utts`` are (utt_id, text, seconds)."""
    rng = np.random.default_rng(len(utts))
    paths, lines = {}, {}
    for utt_id, text, seconds in utts:
        spk, chap, _ = utt_id.split("-")
        folder = corpus / part / spk / chap
        folder.mkdir(parents=True, exist_ok=True)
        t = np.arange(int(seconds * SR)) / SR
        audio = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 400) * t) + 0.01 * rng.standard_normal(t.size)
        paths[utt_id] = folder / f"{utt_id}.flac"
        sf.write(str(paths[utt_id]), audio.astype(np.float32), SR, format="FLAC", subtype="PCM_16")
        lines.setdefault(folder / f"{spk}-{chap}.trans.txt", []).append(f"{utt_id} {text}\n")
    for trans, ls in lines.items():
        trans.write_text("".join(ls))
    return paths


UTTS = [
    ("11-100-0000", "HELLO WORLD", 1.0),
    ("11-100-0001", "GOOD MORNING TO YOU", 1.5),
    ("11-100-0002", "THE QUICK BROWN FOX", 1.2),
    ("12-200-0000", "JUMPS OVER THE LAZY DOG", 2.0),
    ("12-200-0001", "IT'S A TEST", 0.8),
]


def test_bad_flac_files_are_skipped_by_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = tmp_path / "LibriSpeech"
    paths = write_tree(corpus, "dev-clean", UTTS)
    paths["11-100-0001"].write_bytes(b"")  # empty
    data = paths["12-200-0000"].read_bytes()
    paths["12-200-0000"].write_bytes(data[: len(data) // 3])  # truncated
    sf.write(str(paths["11-100-0002"]), np.zeros(SR, dtype=np.float32), SR, format="FLAC")  # digital silence
    paths["12-200-0001"].write_text("not audio at all\n")  # non-audio
    bad = ["11-100-0001", "12-200-0000", "11-100-0002", "12-200-0001"]
    assert audio_error(paths["11-100-0002"]) == "silent: every sample is zero"
    assert all(audio_error(paths[u]) for u in bad)
    assert audio_error(paths["11-100-0000"]) == ""
    out = tmp_path / "manifests"
    with caplog.at_level(logging.WARNING):
        skipped = prepare_librispeech_manifests(corpus, ["dev-clean"], out, num_jobs=2)
    assert skipped == {"dev-clean": 4}
    assert all(str(paths[u]) in caplog.text for u in bad)
    assert "skipped 4 of 5 utterances" in caplog.text
    rec_path, sup_path = manifest_paths(out, "dev-clean")
    sups = load_manifest(sup_path)
    assert [s.id for s in sups] == ["11-100-0000"]
    assert len(load_manifest(rec_path)) == 1
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]


def test_lower_case_is_normalised_and_bad_characters_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "LibriSpeech"
    write_tree(corpus, "test-clean", [("1-2-0000", "hello there", 1.0)])
    prepare_librispeech_manifests(corpus, ["test-clean"], tmp_path / "m")
    assert load_manifest(manifest_paths(tmp_path / "m", "test-clean")[1])[0].text == "HELLO THERE"

    write_tree(corpus, "test-other", [("1-3-0000", "GOOD", 1.0), ("1-3-0001", "NOT GOOD: 42%", 1.0)])
    with pytest.raises(TranscriptError) as err:
        prepare_librispeech_manifests(corpus, ["test-other"], tmp_path / "m")
    msg = str(err.value)
    assert "1-3.trans.txt:2" in msg and "1-3-0001" in msg and "':'" in msg and "'%'" in msg
    assert not manifest_paths(tmp_path / "m", "test-other")[0].exists()


def test_finished_part_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = tmp_path / "LibriSpeech"
    write_tree(corpus, "dev-other", UTTS[:2])
    prepare_librispeech_manifests(corpus, ["dev-other"], tmp_path / "m")
    with caplog.at_level(logging.INFO):
        assert prepare_librispeech_manifests(corpus, ["dev-other"], tmp_path / "m") == {}
    assert "manifests exist" in caplog.text


def test_report_gives_hours_and_oov(tmp_path: Path) -> None:
    corpus = tmp_path / "LibriSpeech"
    write_tree(corpus, "train-clean-100", UTTS[:3])
    write_tree(corpus, "dev-clean", [("13-300-0000", "HELLO STRANGER", 2.0)])
    prepare_librispeech_manifests(corpus, ["train-clean-100", "dev-clean"], tmp_path / "m")
    stats = report_manifests(tmp_path / "m", ["train-clean-100", "dev-clean"])
    assert stats["dev-clean"]["oov_rate"] == pytest.approx(0.5)
    assert stats["train-clean-100"]["hours"] == pytest.approx(3.7 / 3600, rel=1e-3)


def test_download_from_a_local_mirror(tmp_path: Path) -> None:
    """lhotse's real downloader, pointed at a file:// mirror laid out as OpenSLR."""
    src = tmp_path / "src"
    write_tree(src / "LibriSpeech", "dev-clean", UTTS[:2])
    (tmp_path / "mirror" / "12").mkdir(parents=True)
    with tarfile.open(tmp_path / "mirror" / "12" / "dev-clean.tar.gz", "w:gz") as tar:
        tar.add(src / "LibriSpeech", arcname="LibriSpeech")
    dl = tmp_path / "download"
    corpus = download_librispeech(dl, ["dev-clean"], base_url=(tmp_path / "mirror").as_uri())
    assert corpus == dl / "LibriSpeech"
    assert (corpus / "dev-clean" / ".completed").is_file()
    assert (corpus / "dev-clean" / "11" / "100" / "11-100-0000.flac").is_file()
    prepare_librispeech_manifests(corpus, ["dev-clean"], tmp_path / "m")
    assert len(load_manifest(manifest_paths(tmp_path / "m", "dev-clean")[1])) == 2


@pytest.fixture(scope="module")
def fbank_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fbank")
    corpus = root / "LibriSpeech"
    write_tree(corpus, "train-clean-100", UTTS)
    write_tree(corpus, "dev-clean", UTTS[:2])
    prepare_librispeech_manifests(corpus, ["train-clean-100", "dev-clean"], root / "manifests")
    stale = root / "fbank" / "librispeech_feats_dev-clean"
    stale.mkdir(parents=True)
    (stale / "junk-from-a-killed-run.lca").write_bytes(b"x")
    compute_fbank_librispeech(
        root / "manifests", root / "fbank", ["train-clean-100", "dev-clean"], 1, perturb_speed=True
    )
    return root / "fbank"


def test_fbank_manifests_with_speed_perturbation(fbank_dir: Path) -> None:
    train = load_manifest(librispeech_cuts_path(fbank_dir, "train-clean-100"))
    assert len(train) == 3 * len(UTTS)
    assert sum(c.id.endswith("_sp0.9") for c in train) == len(UTTS)
    assert sum(c.id.endswith("_sp1.1") for c in train) == len(UTTS)
    dev = load_manifest(librispeech_cuts_path(fbank_dir, "dev-clean"))
    assert len(dev) == 2  # speed perturbation only for train parts
    feats = dev[0].load_features()
    assert feats.shape == (dev[0].num_frames, 80) and np.isfinite(feats).all()
    assert not (fbank_dir / "librispeech_feats_dev-clean" / "junk-from-a-killed-run.lca").exists()
    assert validate_cut_manifest(librispeech_cuts_path(fbank_dir, "train-clean-100"), load_features=True) == 15


def test_validation_names_the_bad_cut(fbank_dir: Path, tmp_path: Path) -> None:
    cut = load_manifest(librispeech_cuts_path(fbank_dir, "dev-clean"))[0]
    validate_cut(cut, load=True)

    empty = cut.map_supervisions(lambda s: s.transform_text(lambda t: " "))
    with pytest.raises(ManifestError, match=f"cut {cut.id}: supervision .* empty text"):
        validate_cut(empty)
    with pytest.raises(ManifestError, match=f"cut {cut.id}: has no supervision"):
        validate_cut(cut.drop_supervisions())
    validate_cut(cut.drop_supervisions(), supervised=False)

    longer = fastcopy(cut, duration=cut.duration + 0.5)  # the features cover less than the cut
    with pytest.raises(ManifestError, match=f"cut {cut.id}: .* is not covered by its features"):
        validate_cut(longer)
    mismatch = fastcopy(cut, features=fastcopy(cut.features, num_frames=cut.features.num_frames - 7))
    with pytest.raises(ManifestError, match=f"cut {cut.id}: {cut.features.num_frames - 7} feature frames but"):
        validate_cut(mismatch)

    moved = fastcopy(cut, features=fastcopy(cut.features, storage_path=str(tmp_path / "nowhere" / "f.lca")))
    with pytest.raises(ManifestError, match=f"cut {cut.id}: feature file .*nowhere.* is missing"):
        validate_cut(moved)


def test_validate_manifest_script_fails_on_a_bad_manifest(fbank_dir: Path, tmp_path: Path) -> None:
    cuts = load_manifest(librispeech_cuts_path(fbank_dir, "dev-clean"))
    gone = str(tmp_path / "gone" / "feats.lca")

    def moved(c):
        return fastcopy(c, features=fastcopy(c.features, storage_path=gone))

    bad = cuts.map(moved)
    path = tmp_path / "bad_cuts.jsonl.gz"
    bad.to_file(path)
    script = Path(__file__).resolve().parents[1] / "egs/librispeech/ASR/local/validate_manifest.py"
    proc = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert f"cut {cuts[0].id}" in proc.stderr and "is missing" in proc.stderr
    good = subprocess.run(
        [sys.executable, str(script), str(librispeech_cuts_path(fbank_dir, "dev-clean"))],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stderr
