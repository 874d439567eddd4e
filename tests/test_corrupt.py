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
from lhotse.qa import validate

from conftest import RECIPE, recipe_env
from icefall_lite.data.corrupt import DONE_MARKER, CorruptionConfig, CorruptionError, make_corrupted_dir
from icefall_lite.data.corruptions import MIX_KINDS
from icefall_lite.data.datamodule import TRAIN_CUT_DURATION_RANGE, encoder_frames, rejection_reason

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


def _corrupt(tiny_data: Path, out: Path, method: str, fraction: float):
    sp = spm.SentencePieceProcessor()
    sp.load(BPE)
    summary = make_corrupted_dir(
        Path("data/fbank"), out, CorruptionConfig(method=method, fraction=fraction), sp, TRAIN_CUT_DURATION_RANGE
    )
    source = {c.id: c for c in load_manifest(Path("data/fbank") / TRAIN_MANIFEST)}
    corrupted = {c.id: c for c in load_manifest(out / TRAIN_MANIFEST)}
    details = json.loads((out / "corruption.json").read_text())["cuts"]
    return sp, summary, source, corrupted, details


def test_each_outlier_kind_does_what_it_says_and_stays_trainable(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_data)
    sp, summary, source, corrupted, details = _corrupt(tiny_data, tmp_path / "mix", "mix", 0.25)
    assert summary["num_corrupted"] == 10 and list(corrupted) == list(source)
    assert sorted(d["kind"] for d in details.values()) == sorted(2 * list(MIX_KINDS)), "even shares, in turn"
    validate(load_manifest(tmp_path / "mix" / TRAIN_MANIFEST), read_data=True)
    for cut_id, cut in corrupted.items():
        old = source[cut_id]
        if cut_id not in details:
            assert cut.to_dict() == old.to_dict()
            continue
        # Every corrupted cut still passes train.py's filter (else it would never reach training).
        assert rejection_reason(cut, sp, TRAIN_CUT_DURATION_RANGE) == ""
        kind, info, feats, text = (
            details[cut_id]["kind"],
            details[cut_id],
            cut.load_features(),
            cut.supervisions[0].text,
        )
        before = old.load_features()
        if kind == "swap-text":
            assert text == source[info["text_of"]].supervisions[0].text != old.supervisions[0].text
            np.testing.assert_array_equal(feats, before)
            continue
        assert cut.duration == pytest.approx(feats.shape[0] * 0.01) and cut.supervisions[0].duration == cut.duration
        if kind == "truncate":
            np.testing.assert_array_equal(feats, before[: before.shape[0] // 3])
            assert text == old.supervisions[0].text
        elif kind == "concat":
            parts = [before] + [source[i].load_features() for i in info["appended"]]
            np.testing.assert_array_equal(feats, np.concatenate(parts))
            texts = [old.supervisions[0].text] + [source[i].supervisions[0].text for i in info["appended"]]
            assert text == " ".join(texts) and cut.duration <= 20.0
        else:  # silence and noise-burst: the original frames around an inserted block
            at, n = info["at_frame"], info["inserted_frames"]
            np.testing.assert_array_equal(np.concatenate([feats[:at], feats[at + n :]]), before)
            block = feats[at : at + n]
            if kind == "silence":
                assert n == 2 * before.shape[0]
                np.testing.assert_array_equal(block, np.broadcast_to(before.min(axis=0), block.shape))
            else:  # 1 s, 20 dB (ln 100 in the log-mel domain) above each bin's loudest frame, unit jitter
                assert n == 100
                jitter = block - (before.max(axis=0) + np.log(100.0))
                assert abs(float(jitter.mean())) < 0.05 and abs(float(jitter.std()) - 1.0) < 0.05
            assert text == old.supervisions[0].text


def test_a_kind_passes_over_cuts_it_cannot_corrupt_and_says_when_too_few_remain(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny_data)
    sp = spm.SentencePieceProcessor()
    sp.load(BPE)
    cuts = load_manifest(Path("data/fbank") / TRAIN_MANIFEST)
    # A third of a cut under 3 s is under train.py's 1 s minimum: truncate can only use the longer ones.
    long_enough = [
        c
        for c in cuts
        if rejection_reason(c.truncate(duration=c.num_frames // 3 * 0.01), sp, TRAIN_CUT_DURATION_RANGE) == ""
    ]
    assert 0 < len(long_enough) < len(cuts)
    with pytest.raises(CorruptionError, match=rf"only {len(long_enough)} of the 40 cuts.*lower the fraction"):
        make_corrupted_dir(
            Path("data/fbank"),
            tmp_path / "t",
            CorruptionConfig(method="truncate", fraction=1.0),
            sp,
            TRAIN_CUT_DURATION_RANGE,
        )
    assert not (tmp_path / "t" / DONE_MARKER).exists(), "nothing marked done"
