"""The corrupted training set of local/make_corrupted_cuts.py (icefall_lite/data/corrupt.py):
deterministic, the exact fraction, which cuts, what changes, reruns and bad settings."""

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict

import numpy as np
import pytest
import sentencepiece as spm
from lhotse import load_manifest

from conftest import RECIPE, recipe_env
from icefall_lite.data.corrupt import CorruptionConfig, CorruptionError, make_corrupted_dir
from icefall_lite.data.datamodule import (
    TRAIN_CUT_DURATION_RANGE,  # noqa: E402
    encoder_frames,
)

CORRUPT = RECIPE / "local" / "make_corrupted_cuts.py"
TRAIN_MANIFEST = "librispeech_cuts_train-clean-100.jsonl.gz"
BPE = "data/lang_bpe_100/bpe.model"
FRACTION = 0.1  # 4 of the tiny corpus's 40 training cuts


def read_cuts(path: Path) -> Dict[str, dict]:
    """{cut id: cut dict} of a gzipped JSONL manifest, read without lhotse."""
    with gzip.open(path, "rt") as f:
        return {c["id"]: c for c in map(json.loads, f)}


def test_corrupted_set_is_deterministic_with_the_exact_fraction(tiny_data, tmp_path):
    cli = subprocess.run(
        [
            sys.executable,
            str(CORRUPT),
            "--src-dir",
            "data/fbank",
            "--out-dir",
            str(tmp_path / "cli"),
            "--bpe-model",
            BPE,
            "--fraction",
            str(FRACTION),
            "--seed",
            "7",
        ],
        cwd=tiny_data,
        capture_output=True,
        text=True,
        env=recipe_env(),
    )
    assert cli.returncode == 0, cli.stderr
    sp = spm.SentencePieceProcessor()
    sp.load(str(tiny_data / BPE))
    make_corrupted_dir(
        tiny_data / "data" / "fbank",
        tmp_path / "lib",
        CorruptionConfig(fraction=FRACTION, seed=7),
        sp,
        TRAIN_CUT_DURATION_RANGE,
    )
    make_corrupted_dir(
        tiny_data / "data" / "fbank",
        tmp_path / "seed8",
        CorruptionConfig(fraction=FRACTION, seed=8),
        sp,
        TRAIN_CUT_DURATION_RANGE,
    )

    source = read_cuts(tiny_data / "data" / "fbank" / TRAIN_MANIFEST)
    corrupted = read_cuts(tmp_path / "cli" / TRAIN_MANIFEST)
    assert list(corrupted) == list(source), "same cuts in the same order"
    changed = sorted(i for i in source if source[i] != corrupted[i])
    assert len(changed) == round(FRACTION * len(source)) == 4
    assert (tmp_path / "cli" / "corrupted_cut_ids.txt").read_text().split() == changed
    # Deterministic: the same seed gives the same set (script and library); another seed other cuts.
    assert read_cuts(tmp_path / "lib" / TRAIN_MANIFEST) == corrupted
    assert (tmp_path / "seed8" / "corrupted_cut_ids.txt").read_text().split() != changed
    for cut_id in changed:
        old, new = source[cut_id], corrupted[cut_id]
        assert 1.0 <= old["duration"] <= 20.0, "only cuts that train.py trains on"
        assert {k: v for k, v in new.items() if k != "supervisions"} == {
            k: v for k, v in old.items() if k != "supervisions"
        }
        old_text, new_text = old["supervisions"][0]["text"], new["supervisions"][0]["text"]
        assert new_text != old_text
        frames = encoder_frames(old["features"]["num_frames"])
        # Denser than the real transcript, yet short enough for the transducer (tokens <= frames).
        assert len(sp.encode(old_text)) < len(sp.encode(new_text)) <= frames
    # The other manifests are the clean ones.
    for name in ("librispeech_cuts_dev-clean.jsonl.gz", "librispeech_cuts_test-other.jsonl.gz", "noise_cuts.jsonl.gz"):
        assert read_cuts(tmp_path / "cli" / name) == read_cuts(tiny_data / "data" / "fbank" / name)
    # At least one cut for a small fraction.
    few = make_corrupted_dir(
        tiny_data / "data" / "fbank", tmp_path / "few", CorruptionConfig(fraction=0.001), sp, TRAIN_CUT_DURATION_RANGE
    )
    assert few["num_corrupted"] == 1


def test_corrupted_set_rerun_and_other_settings(tiny_data, tmp_path):
    sp = spm.SentencePieceProcessor()
    sp.load(str(tiny_data / BPE))
    src = tiny_data / "data" / "fbank"
    make_corrupted_dir(src, tmp_path / "c", CorruptionConfig(fraction=FRACTION), sp, TRAIN_CUT_DURATION_RANGE)
    mtime = (tmp_path / "c" / TRAIN_MANIFEST).stat().st_mtime_ns
    make_corrupted_dir(src, tmp_path / "c", CorruptionConfig(fraction=FRACTION), sp, TRAIN_CUT_DURATION_RANGE)
    assert (tmp_path / "c" / TRAIN_MANIFEST).stat().st_mtime_ns == mtime
    with pytest.raises(CorruptionError, match=r"made with other settings.*remove it or choose another output"):
        make_corrupted_dir(src, tmp_path / "c", CorruptionConfig(fraction=0.2), sp, TRAIN_CUT_DURATION_RANGE)
    with pytest.raises(CorruptionError, match=r"fraction of corrupted cuts must be in \(0, 1\]"):
        make_corrupted_dir(src, tmp_path / "d", CorruptionConfig(fraction=0.0), sp, TRAIN_CUT_DURATION_RANGE)
    cli = subprocess.run(
        [sys.executable, str(CORRUPT), "--out-dir", str(tmp_path / "e"), "--bpe-model", "missing.model"],
        cwd=tiny_data,
        capture_output=True,
        text=True,
        env=recipe_env(),
    )
    assert cli.returncode == 1 and "--bpe-model missing.model does not exist" in cli.stderr


def test_scale_features_multiplies_only_the_chosen_cuts(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_data)  # feature paths in the manifests are relative to the work dir
    sp = spm.SentencePieceProcessor()
    sp.load(BPE)
    out = tmp_path / "scaled"
    make_corrupted_dir(
        Path("data/fbank"),
        out,
        CorruptionConfig(method="scale-features", fraction=FRACTION, scale=3.0),
        sp,
        TRAIN_CUT_DURATION_RANGE,
    )
    chosen = set((out / "corrupted_cut_ids.txt").read_text().split())
    source = {c.id: c for c in load_manifest(Path("data/fbank") / TRAIN_MANIFEST)}
    scaled = {c.id: c for c in load_manifest(out / TRAIN_MANIFEST)}
    assert len(chosen) == 4 and chosen <= set(source)
    for cut_id, cut in scaled.items():
        original = source[cut_id].load_features()
        if cut_id in chosen:
            np.testing.assert_array_equal(cut.load_features(), original * np.float32(3.0))
            assert cut.supervisions[0].text == source[cut_id].supervisions[0].text
        else:
            assert cut.to_dict() == source[cut_id].to_dict()
