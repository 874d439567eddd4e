"""Data faults at decoding/validation time: NaN/inf features, missing feature files, an empty cut set.

Each must stop with an error naming the cut and the fix, never produce hypotheses
from garbage. (Bad audio and transcripts at preparation time: test_data_manifests.py;
too-short utterances and more tokens than frames: test_data_module.py.)
"""

import argparse
import shutil
from pathlib import Path
from typing import List

import numpy as np
import pytest
from lhotse import CutSet, load_manifest
from lhotse.cut import Cut

from conftest import with_features
from icefall_lite.data.datamodule import (
    EmptyCutSetError,
    FeaturesUnreadableError,
    LibriSpeechAsrDataModule,
    NonFiniteFeaturesError,
)


@pytest.fixture(autouse=True)
def _in_tiny_data(tiny_data, monkeypatch):
    """Feature paths in the tiny corpus's manifests are relative to its work dir."""
    monkeypatch.chdir(tiny_data)


def _datamodule(manifest_dir: Path) -> LibriSpeechAsrDataModule:
    parser = argparse.ArgumentParser()
    LibriSpeechAsrDataModule.add_arguments(parser, max_duration=100.0)
    args = parser.parse_args(["--manifest-dir", str(manifest_dir), "--num-workers", "0", "--max-duration", "1000"])
    return LibriSpeechAsrDataModule(args)


def _test_cuts(tiny_data: Path) -> List[Cut]:
    return list(load_manifest(tiny_data / "data" / "fbank" / "librispeech_cuts_test-clean.jsonl.gz"))[:3]


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_non_finite_features_name_the_cut(tiny_data, tmp_path, bad_value):
    good_a, victim, good_b = _test_cuts(tiny_data)
    feats = victim.load_features().copy()
    feats[3, 7] = bad_value
    cuts = CutSet.from_cuts([good_a, with_features(victim, feats, tmp_path / "feats"), good_b])
    dm = _datamodule(tiny_data / "data" / "fbank")
    with pytest.raises(NonFiniteFeaturesError) as err:
        list(dm.test_dataloaders(cuts))
    msg = str(err.value)
    assert f"[{victim.id!r}]" in msg, msg  # exactly the victim, not its batch mates
    assert "prepare.sh --stage 2" in msg and "validate_manifest.py" in msg
    # The same cuts with finite features decode as one batch of three.
    clean = CutSet.from_cuts([good_a, with_features(victim, victim.load_features(), tmp_path / "ok"), good_b])
    batches = list(dm.test_dataloaders(clean))
    assert sum(b["inputs"].size(0) for b in batches) == 3


def test_missing_feature_file_names_the_cut_and_file(tiny_data, tmp_path):
    good, victim, _ = _test_cuts(tiny_data)
    feats_dir = tmp_path / "feats"
    moved = with_features(victim, victim.load_features(), feats_dir)
    shutil.rmtree(feats_dir)
    dm = _datamodule(tiny_data / "data" / "fbank")
    with pytest.raises(FeaturesUnreadableError) as err:
        list(dm.test_dataloaders(CutSet.from_cuts([good, moved])))
    msg = str(err.value)
    assert victim.id in msg and good.id not in msg
    assert str(feats_dir) in msg and "prepare.sh --stage 2" in msg


def test_empty_test_cut_set_is_refused(tiny_data):
    dm = _datamodule(tiny_data / "data" / "fbank")
    with pytest.raises(EmptyCutSetError, match="test cut set is empty"):
        dm.test_dataloaders(CutSet.from_cuts([]))
